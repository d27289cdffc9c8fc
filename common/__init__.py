"""What every package stands on and that imports nothing of the project: the error root
(`errors.py`), the settings checks (`checks.py`) and child processes that die with their
parent (`processes.py`)."""
