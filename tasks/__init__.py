"""echo.tasks."""
