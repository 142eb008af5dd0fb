"""The engine processes: the shell both engines run (shell.py) around the rolling batch's core
(rolling_core.py), the MPI ranks (process.py, ranks.py), sampling, statistics."""
