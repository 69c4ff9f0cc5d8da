"""echo.p2p."""
