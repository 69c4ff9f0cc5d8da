"""echo.node.engines."""
