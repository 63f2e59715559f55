"""`python -m mlx_gated_delta lm server` as a subprocess on a free port of
127.0.0.1, and a small HTTP client of its OpenAI-style endpoints (urllib
only): what the end-to-end tests and the server benchmark share. Every wait
is bounded; `stop()` ends the process (and is safe to call twice)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

START_TIMEOUT = 60  # seconds for the server to answer /health
REQUEST_TIMEOUT = 120  # seconds for one request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LmServer:
    """`lm server ARGS` started in `cwd`, answering on `self.port`."""

    def __init__(self, *args, cwd=None, max_tokens: int = 8):
        self.port = free_port()
        self.max_tokens = max_tokens
        # A file, not a pipe: a full pipe would block the server.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed in stop)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlx_gated_delta", "lm", "server"]
            + ["--host", "127.0.0.1", "--port", str(self.port), *map(str, args)],
            cwd=cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output = None
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.stop()[-3000:]}")
            try:
                urllib.request.urlopen(self.url("/health"), timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    message = f"no answer in {START_TIMEOUT} s:\n{self.stop()[-3000:]}"
                    raise RuntimeError(message) from None
                time.sleep(0.2)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict):
        request = urllib.request.Request(
            self.url(path),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        return urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT)

    def _body(self, **fields) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": 0.0, **fields}

    def chat(self, messages: list, **options) -> dict:
        """A chat completion at temperature 0: the response's JSON."""
        body = self._body(messages=messages, **options)
        return json.loads(self.post("/v1/chat/completions", body).read())

    def chat_streamed(self, messages: list, **options) -> str:
        """A streamed chat completion at temperature 0: its text."""
        body = self._body(messages=messages, stream=True, **options)
        text = []
        with self.post("/v1/chat/completions", body) as response:
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
        return "".join(text)

    def complete(self, prompt: str, **options) -> dict:
        """A text completion at temperature 0: the response's JSON."""
        body = self._body(prompt=prompt, **options)
        return json.loads(self.post("/v1/completions", body).read())

    def stop(self) -> str:
        """Stops the server (once); what it printed."""
        if self.output is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)
            self.log.seek(0)
            self.output = self.log.read()
            self.log.close()
        return self.output


def chat_of(user: str, system: str | None = None) -> list:
    """The messages of a chat: an optional system prompt, one user turn."""
    messages = [{"role": "user", "content": user}]
    return ([{"role": "system", "content": system}] if system else []) + messages
