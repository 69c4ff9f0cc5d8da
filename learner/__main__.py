"""``python -m echo.learner``: the learner process the coordinator starts for a job."""

from echo.learner.cli import main

if __name__ == "__main__":
    main()
