"""gunicorn settings for the front end (`gunicorn -c` this file).

gthread workers: request threads block on engine replies, not on CPU, so a few processes with
many threads each carry hundreds of waiting requests. The web workers do no model compute (the
engine owns the cores), and each opens its own engine socket after forking (`create_app` runs
in the worker, never preloaded).
"""

worker_class = "gthread"
workers = 2
threads = 64
preload_app = False
# gthread workers heartbeat from their main loop, so long generations never trip this.
timeout = 120
# On SIGTERM (`docker stop`), requests in flight finish for up to this long; docker sends SIGKILL
# 10 s after SIGTERM by default, so the front end's drain ends early enough for the engine to stop
# too and the server to exit 0.
graceful_timeout = 8
keepalive = 5
accesslog = "-"
access_log_format = '%(h)s "%(r)s" %(s)s %(B)s %(M)sms x-request-id=%({x-request-id}o)s'
errorlog = "-"
loglevel = "info"
# Several servers on one machine (tests, benchmarks) would fight over the default control
# socket path; lmserve supervises gunicorn itself.
control_socket_disable = True
