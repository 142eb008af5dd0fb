"""gunicorn settings for the front end (`gunicorn -c` this file).

gthread workers: request threads block on engine replies, not on CPU, so a few processes with
many threads each carry hundreds of waiting requests. The web workers do no model compute (the
engine owns the cores), and each opens its own engine socket after forking (`create_app` runs
in the worker, never preloaded).

They also run at the lowest CPU priority. The engine's threads fill every core during a burst,
and its steps are split between them: a web worker that wakes for a streamed token and takes a
core from one of them makes the other wait for it at the step's end. At nice 19 the scheduler
seldom preempts an engine thread for them; they stay well served, needing a few percent of a
core. One server on a 2-core Zen 4, rounds alternating nice 0 and 19 on the same prompts: the
burst of 32 at 509 against 535 tokens/s (three rounds each), TTFT p50 1.15-1.25 against
1.13 s (benchmarks/README.md, performance log).
"""

import os

worker_class = "gthread"
workers = 2
threads = 64
preload_app = False
# gthread workers heartbeat from their main loop, so long generations never trip this.
timeout = 120
graceful_timeout = 10
keepalive = 5
accesslog = "-"
access_log_format = '%(h)s "%(r)s" %(s)s %(B)s %(M)sms x-request-id=%({x-request-id}o)s'
errorlog = "-"
loglevel = "info"
# Several servers on one machine (tests, benchmarks) would fight over the default control
# socket path; lmserve supervises gunicorn itself.
control_socket_disable = True

WEB_WORKER_NICENESS = 19


def on_starting(server) -> None:
    """Runs in gunicorn's master before it forks the workers, which inherit its niceness."""
    os.nice(max(0, WEB_WORKER_NICENESS - os.nice(0)))
