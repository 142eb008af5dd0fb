"""`make image-test`: builds the image on a Debian base of its own and checks it, running.

Started by test_image.sh, which provides a BuildKit docker client (DOCKER) and its daemon, with
.venv's Python in safe-path mode. Each scenario prints PASS or FAIL (with why); the last line is
`N passed, N failed`, and the exit status is non-zero on any failure. The embedded default runs
as README says (`docker run -p PORT:8080`); the others share the host's network (the S3 server
listens on its loopback), each serving on a free port. Waits poll for what they look for: their
deadlines only guard against hangs, and nothing rests on how fast this machine is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCKER = os.environ.get("DOCKER", "docker")
IMAGE = os.environ.get("IMAGE", "lmserve:test")
BASE_IMAGE = os.environ.get("BASE_IMAGE", "lmserve-base:bookworm")
HUB_ID = "lmserve-test/tiny-llama"
S3_URL = "s3://bucket/models/tiny"
# README's request, and what it answers.
README_REQUEST = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 16}}
# Hang guards (seconds), not expectations.
BUILD_TIMEOUT = 1800
START_TIMEOUT = 600
REQUEST_TIMEOUT = 300
# What one in-flight request should last, at the decode speed measured just before: long enough
# to be mid-stream when `docker stop` arrives, short beside gunicorn's graceful_timeout (8 s),
# which must also cover four of them batched and a machine that slows down meanwhile.
IN_FLIGHT_SECONDS = 1.5
STREAMS = 4
PROBE_TOKENS = 32
# The rank of a one-rank MPI engine: `python -P -m mpi4py -m lmserve...process RUNTIME`.
KILL_RANK = """
import os, signal
ranks = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    if b"mpi4py" in argv and os.path.basename(argv[0]).startswith(b"python"):
        ranks.append(int(pid))
assert len(ranks) == 1, ranks
os.kill(ranks[0], signal.SIGKILL)
print(ranks[0])
"""


def load_tests_package() -> None:
    """The repository's tests/ as the package `tests`, as pytest's importlib mode loads it,
    without putting the repository root on sys.path (its kernels/ would shadow an installed
    package of that name)."""
    init = ROOT / "tests" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "tests", init, submodule_search_locations=[str(init.parent)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tests"] = module
    spec.loader.exec_module(module)


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    result = subprocess.run(
        [DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {result.returncode}\n{result.stderr}")
    return result.stdout


class Container:
    """`docker run -d --network host IMAGE serve --port PORT`, or with `published` README's
    `docker run -p PORT:8080 IMAGE serve` (docker's bridge network); removed when the block
    ends."""

    def __init__(
        self, scenario: str, env: dict[str, str] | None = None, volumes=(), published=False
    ):
        from tests.servers import free_port

        self.port = free_port()
        self.name = f"lmserve-image-test-{scenario}-{os.getpid()}"
        self.url = f"http://127.0.0.1:{self.port}"
        command = ["run", "-d", "--name", self.name]
        for key, value in (env or {}).items():
            command += ["-e", f"{key}={value}"]
        for host_path, path in volumes:
            command += ["-v", f"{host_path}:{path}:ro"]
        if published:
            command += ["-p", f"127.0.0.1:{self.port}:8080", IMAGE, "serve"]
        else:
            command += ["--network", "host", IMAGE, "serve", "--port", str(self.port)]
        self.started = time.monotonic()
        docker(*command)

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        docker("rm", "-f", self.name, check=False)

    def state(self) -> dict:
        return json.loads(docker("inspect", "-f", "{{json .State}}", self.name))

    def logs(self, tail: int = 40) -> str:
        result = subprocess.run(
            [DOCKER, "logs", "--tail", str(tail), self.name],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return result.stdout + result.stderr

    def wait_healthy(self) -> float:
        """Seconds from `docker run` to the first /ping 200."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/ping", timeout=10).status_code == 200:
                    return time.monotonic() - self.started
            except requests.RequestException:
                pass  # not listening yet
            state = self.state()
            if not state["Running"]:
                raise AssertionError(f"exited with {state['ExitCode']}:\n{self.logs()}")
            time.sleep(0.2)
        raise AssertionError(f"/ping not 200 within {START_TIMEOUT} s:\n{self.logs()}")

    def generate(self, body: dict) -> dict:
        answer = requests.post(f"{self.url}/invocations", json=body, timeout=REQUEST_TIMEOUT)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def model_url(self) -> str:
        (model,) = requests.get(f"{self.url}/models", timeout=60).json()["models"]
        return model["modelUrl"]

    def stop(self) -> int:
        """`docker stop` with docker's own timeout (10 s, then SIGKILL): the exit code."""
        docker("stop", self.name, timeout=REQUEST_TIMEOUT)
        return self.state()["ExitCode"]

    def wait_exit(self) -> int:
        return int(docker("wait", self.name, timeout=START_TIMEOUT).strip())


class Stream(threading.Thread):
    """One streamed (jsonlines) greedy request of `tokens` new tokens, read to its end."""

    def __init__(self, url: str, tokens: int):
        super().__init__(daemon=True)
        self.body = {
            "inputs": "Once upon a time",
            "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True, "details": True},
            "stream": True,
        }
        self.url = url
        self.status: int | None = None
        self.events: list[dict] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            with requests.post(
                f"{self.url}/invocations", json=self.body, stream=True, timeout=REQUEST_TIMEOUT
            ) as answer:
                self.status = answer.status_code
                for line in answer.iter_lines():
                    if line:
                        self.events.append(json.loads(line))
        except Exception as error:  # the check reports it
            self.error = repr(error)

    @property
    def tokens(self) -> int:
        return sum("token" in event for event in self.events)


class ImageTest:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.passed = 0
        self.failed = 0
        self.numbers: dict[str, str] = {}
        self._tiny: Path | None = None

    def check(self, name: str, scenario: Callable[[], str | None]) -> bool:
        started = time.monotonic()
        try:
            note = scenario()
        except Exception as error:
            self.failed += 1
            detail = str(error) if isinstance(error, AssertionError) else traceback.format_exc()
            print(f"FAIL {name} ({time.monotonic() - started:.0f} s)\n{detail}", flush=True)
            return False
        self.passed += 1
        suffix = f": {note}" if note else ""
        print(f"PASS {name} ({time.monotonic() - started:.0f} s){suffix}", flush=True)
        return True

    def not_run(self, names: list[str], reason: str) -> None:
        for name in names:
            self.failed += 1
            print(f"FAIL {name}: not run, {reason}", flush=True)

    # --- building ---

    def _script(self, name: str, *args: str, env: dict[str, str]) -> float:
        log = self.workdir / f"{name}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            code = subprocess.run(
                [str(HERE / name), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                timeout=BUILD_TIMEOUT,
            ).returncode
        seconds = time.monotonic() - started
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        assert code == 0, f"{name} exited with {code}:\n{tail}"
        return seconds

    def base(self) -> str:
        seconds = self._script("base.sh", BASE_IMAGE, env={})
        self.numbers["base"] = f"{BASE_IMAGE}, ready in {seconds:.0f} s"
        return self.numbers["base"]

    def build(self) -> str:
        env = {"IMAGE": IMAGE, "BASE_IMAGE": BASE_IMAGE, "PYTHON": sys.executable}
        seconds = self._script("build.sh", env=env)
        size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE))
        self.numbers["build"] = f"{seconds:.0f} s"
        self.numbers["image size"] = f"{size / 1e9:.2f} GB ({size} bytes)"
        return f"{IMAGE}, {self.numbers['image size']}, {seconds:.0f} s"

    def rebuild(self) -> str:
        before = docker("image", "inspect", "-f", "{{.Id}}", IMAGE).strip()
        env = {"IMAGE": IMAGE, "BASE_IMAGE": BASE_IMAGE, "PYTHON": sys.executable}
        seconds = self._script("build.sh", env=env)
        after = docker("image", "inspect", "-f", "{{.Id}}", IMAGE).strip()
        assert after == before, f"an unchanged rebuild made another image: {before} -> {after}"
        self.numbers["cached rebuild"] = f"{seconds:.0f} s"
        return f"same image, {seconds:.0f} s"

    def no_pip_configuration(self) -> str:
        """Nothing of this machine's pip configuration (nor of its translation) is in a layer,
        the history or the image's settings; pip in the image has no configuration at all."""
        sys.path.insert(0, str(HERE))
        from pip_passthrough import pip_config

        values = {
            item
            for options in pip_config().values()
            for value in options.values()
            for item in value.split()
            if "/" in item  # paths and URLs: '1' or '180' are everywhere
        }
        assert values, "this machine has no pip configuration to look for"
        history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGE)
        settings = docker("image", "inspect", IMAGE)
        for text, where in ((history, "docker history"), (settings, "docker image inspect")):
            for value in [*values, "127.0.0.1"]:
                assert value not in text, f"{value!r} in {where}"
        listed = docker("run", "--rm", "--entrypoint", "pip", IMAGE, "config", "list")
        assert listed.strip() == "", f"pip config list in the image: {listed}"
        debug = docker("run", "--rm", "--entrypoint", "pip", IMAGE, "config", "debug")
        assert "exists: True" not in debug, f"a pip configuration file in the image:\n{debug}"
        leftovers = docker(
            "run", "--rm", "--entrypoint", "sh", IMAGE, "-c", "ls -A /run/secrets 2>/dev/null"
        )
        assert leftovers.strip() == "", f"/run/secrets in the image holds {leftovers}"
        return f"{len(values)} values looked for"

    # --- running ---

    def tiny_model(self) -> Path:
        """A random-weight two-layer Llama with SmolLM2's tokenizer (tests/conftest.py)."""
        if self._tiny is None:
            from lmserve.rolling_batch.model.weights.gguf_convert import (
                convert_gguf_once,
                embedded_gguf,
            )
            from tests.conftest import TEST_CACHE_DIR, save_tiny_llama

            smollm2 = convert_gguf_once(embedded_gguf(), TEST_CACHE_DIR)
            self._tiny = save_tiny_llama(self.workdir / "tiny-llama", smollm2)
        return self._tiny

    def model_folder(self, name: str, properties: dict[str, object], weights: bool) -> Path:
        from tests.servers import write_properties

        folder = self.workdir / name
        if weights:
            shutil.copytree(self.tiny_model(), folder)
        return write_properties(folder, properties)

    def default_model(self) -> str:
        with Container("default", published=True) as container:
            cold_start = container.wait_healthy()
            text = container.generate(README_REQUEST)["generated_text"]
            assert "Paris" in text, text
            assert container.stop() == 0, container.logs()
        self.numbers["cold start"] = f"{cold_start:.1f} s (docker run -> /ping 200)"
        return f"/ping 200 {cold_start:.1f} s after docker run; {text!r}"

    def stop_in_flight(self) -> str:
        from tests.servers import decode_step_seconds, wait_until

        with Container("stop") as container:
            container.wait_healthy()
            step_s = decode_step_seconds(container, probe_tokens=PROBE_TOKENS)
            tokens = min(2000, math.ceil(IN_FLIGHT_SECONDS / step_s))
            streams = [Stream(container.url, tokens) for _ in range(STREAMS)]
            for stream in streams:
                stream.start()
            wait_until(
                lambda: all(s.tokens or s.error or s.status not in (None, 200) for s in streams),
                "every stream's first token",
                timeout=REQUEST_TIMEOUT,
            )
            at_stop = [stream.tokens for stream in streams]
            assert all(0 < count < tokens for count in at_stop), (at_stop, tokens)
            started = time.monotonic()
            code = container.stop()
            seconds = time.monotonic() - started
            for stream in streams:
                stream.join(timeout=REQUEST_TIMEOUT)
            logs = container.logs()
        assert code == 0, f"exit code {code} after docker stop:\n{logs}"
        for stream in streams:
            assert stream.error is None and stream.status == 200, (stream.status, stream.error)
            assert stream.tokens == tokens, f"{stream.tokens} of {tokens} tokens"
            details = stream.events[-1].get("details") or {}
            assert details.get("finish_reason") == "length", stream.events[-1]
        return (
            f"{STREAMS} streams of {tokens} tokens ({step_s * 1e3:.0f} ms a step alone),"
            f" at {at_stop} when stopped, all whole;"
            f" exit 0 {seconds:.1f} s after docker stop"
        )

    def mounted_folder(self) -> str:
        folder = self.model_folder("mounted", {"option.max_rolling_batch_size": 8}, weights=True)
        with Container("folder", volumes=[(folder, "/opt/ml/model")]) as container:
            container.wait_healthy()
            text = container.generate({"inputs": "Hello", "parameters": {"max_new_tokens": 5}})
            assert isinstance(text["generated_text"], str), text
            source = container.model_url()
            assert source == "/opt/ml/model", source
            assert container.stop() == 0, container.logs()
        return f"served from {source}"

    def engine_killed(self) -> str:
        folder = self.model_folder("killed", {"option.max_rolling_batch_size": 8}, weights=True)
        with Container("killed", volumes=[(folder, "/opt/ml/model")]) as container:
            container.wait_healthy()
            pid = docker("exec", container.name, "python", "-P", "-c", KILL_RANK).strip()
            code = container.wait_exit()
            logs = container.logs()
        # 1 is lmserve's own verdict; 137 would be docker's SIGKILL, not the supervisor's.
        assert code == 1, f"exit code {code}:\n{logs}"
        assert "engine exited" in logs, logs
        return f"rank {pid} killed with SIGKILL: the container exited {code}"

    def hf_model_id(self) -> str:
        hub = self.workdir / "hf" / "hub"
        repo = hub / f"models--{HUB_ID.replace('/', '--')}"
        commit = hashlib.sha1(HUB_ID.encode()).hexdigest()
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (repo / "blobs").mkdir()
        # huggingface_hub's layout: content-addressed blobs, the snapshot links to them.
        for path in sorted(self.tiny_model().iterdir()):
            blob = hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, repo / "blobs" / blob)
            (snapshot / path.name).symlink_to(f"../../blobs/{blob}")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        env = {"HF_MODEL_ID": HUB_ID, "HF_HUB_CACHE": "/opt/hf/hub", "HF_HUB_OFFLINE": "1"}
        with Container("hub", env=env, volumes=[(hub.parent, "/opt/hf")]) as container:
            container.wait_healthy()
            text = container.generate({"inputs": "Hello", "parameters": {"max_new_tokens": 5}})
            assert isinstance(text["generated_text"], str), text
            source = container.model_url()
            assert source == f"hub {HUB_ID}", source
            assert container.stop() == 0, container.logs()
        return f"served {source} from the mounted cache, offline"

    def s3_model(self) -> str:
        import boto3

        from tests.container.s3_server import start_s3_server, stop_s3_server, upload_folder

        server = start_s3_server(self.workdir / "moto_server.log")
        try:
            env = server.env()
            client = boto3.client(
                "s3",
                endpoint_url=server.url,
                region_name=env["AWS_DEFAULT_REGION"],
                aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            )
            client.create_bucket(Bucket="bucket")
            uploaded = upload_folder(client, self.tiny_model(), "bucket", "models/tiny")
            folder = self.model_folder("s3", {"option.model_id": S3_URL}, weights=False)
            with Container("s3", env=env, volumes=[(folder, "/opt/ml/model")]) as container:
                container.wait_healthy()
                body = {"inputs": "Hello", "parameters": {"max_new_tokens": 5}}
                text = container.generate(body)
                assert isinstance(text["generated_text"], str), text
                source = container.model_url()
                assert source == S3_URL, source
                assert container.stop() == 0, container.logs()
        finally:
            stop_s3_server(server)
        return f"{len(uploaded)} files from {S3_URL} on {server.url}"

    def run(self) -> int:
        built = self.check(f"base image {BASE_IMAGE} (mmdebstrap, docker import)", self.base)
        built = built and self.check(f"image build {IMAGE}", self.build)
        scenarios = [
            ("cached rebuild: the same image", self.rebuild),
            ("no pip configuration in a layer, the history or pip's", self.no_pip_configuration),
            ("embedded default, docker run -p: /ping, README's request", self.default_model),
            ("docker stop with requests in flight: all whole, exit 0", self.stop_in_flight),
            ("model folder with serving.properties mounted at /opt/ml/model", self.mounted_folder),
            ("engine rank killed in the container: the container exits 1", self.engine_killed),
            ("HF_MODEL_ID from a mounted hub cache, HF_HUB_OFFLINE=1", self.hf_model_id),
            ("option.model_id=s3://... from a local S3 server", self.s3_model),
        ]
        if built:
            for name, scenario in scenarios:
                self.check(name, scenario)
        else:
            self.not_run([name for name, _ in scenarios], "no image")
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        models = [line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line]
        print(f"numbers ({models[0] if models else 'CPU'}, {os.cpu_count()} cores):")
        for name, value in self.numbers.items():
            print(f"  {name}: {value}")
        print(f"{self.passed} passed, {self.failed} failed")
        return 1 if self.failed else 0


def main() -> int:
    load_tests_package()
    workdir = Path(tempfile.mkdtemp(prefix="lmserve-image-test-"))
    try:
        return ImageTest(workdir).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
