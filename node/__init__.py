"""echo.node."""
