"""What crosses between processes: the socket's messages (protocol.py), the engine side of the
socket (router.py), the runtime and state files (runtime.py). Torch-free: the front end, both
engines and the supervisor import it."""
