"""What every package stands on and that imports nothing of the project: the error root
(`errors.py`) and the settings checks (`checks.py`)."""
