"""echo.coordinator."""
