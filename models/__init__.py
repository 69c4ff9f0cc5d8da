"""echo.models."""
