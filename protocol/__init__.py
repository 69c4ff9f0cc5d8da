"""echo.protocol."""
