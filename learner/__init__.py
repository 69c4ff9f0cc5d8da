"""echo.learner."""
