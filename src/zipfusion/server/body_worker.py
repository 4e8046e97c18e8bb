"""Large request bodies parsed and validated in a worker process (:func:`main`): the parse holds
that process's GIL, not the one the engine thread shares with the event loop. The reply comes back
pickled in pieces of at most ``PIECE`` objects, each unpickled in one short hold of the server's GIL.
Imports neither torch nor fastapi.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import time

from pydantic import BaseModel

from .protocol import BadRequest, load_body

PIECE = 4096  # most objects one unpickle call builds
PAUSE_S = 1e-4  # a sleep between pieces: a thread waiting for the GIL (the engine's) takes it then
_LEN = struct.Struct("<Q")
_LEAVES = (int, float, str, bool, type(None))


def _children(obj) -> list | None:
    if type(obj) in (list, tuple):
        return obj
    if type(obj) is dict:
        return list(obj.values())
    if isinstance(obj, BaseModel):
        return [obj.__dict__] + ([obj.__pydantic_extra__] if obj.__pydantic_extra__ else [])
    if isinstance(obj, BaseException):
        return [obj.args, obj.__dict__]
    return None


def _weights(root) -> dict[int, int]:
    """id -> how many objects each container under ``root`` holds (itself and dict keys included)."""
    weights, stack = {}, [(root, False)]
    while stack:
        obj, done = stack.pop()
        kids = _children(obj)
        if kids is None:
            continue
        if set(map(type, kids)).issubset(_LEAVES):
            weights[id(obj)] = 1 + len(kids) * (2 if type(obj) is dict else 1)
        elif done:
            weights[id(obj)] = 1 + (len(kids) if type(obj) is dict else 0) + sum(weights.get(id(k), 1) for k in kids)
        else:
            stack.append((obj, True))
            stack.extend((k, False) for k in kids if type(k) not in _LEAVES)
    return weights


class _Packer(pickle.Pickler):
    """Pickles a list or dict heavier than PIECE as a persistent id holding its elements' pickles in
    pieces of at most PIECE objects (a heavier element alone, packed the same way)."""

    def __init__(self, file, weights: dict[int, int]):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.weights = weights

    def persistent_id(self, obj):
        if type(obj) not in (list, dict) or self.weights.get(id(obj), 0) <= PIECE:
            return None
        is_dict = type(obj) is dict
        pieces, group, size = [], [], 0
        for x in obj.items() if is_dict else obj:
            w = self.weights.get(id(x[1] if is_dict else x), 1) + 2 * is_dict  # a key, a pair
            if group and size + w > PIECE:
                pieces.append(_dumps(group, self.weights))
                group, size = [], 0
            group.append(x)
            size += w
        pieces.append(_dumps(group, self.weights))
        return is_dict, pieces


def _dumps(obj, weights: dict[int, int]) -> bytes:
    f = io.BytesIO()
    _Packer(f, weights).dump(obj)
    return f.getvalue()


def dumps(obj) -> bytes:
    return _dumps(obj, _weights(obj))


class _Unpacker(pickle.Unpickler):
    def persistent_load(self, pid):
        is_dict, pieces = pid
        out = {} if is_dict else []
        for piece in pieces:
            part = _Unpacker(io.BytesIO(piece)).load()
            out.update(part) if is_dict else out.extend(part)
            time.sleep(PAUSE_S)
        return out


def loads(data: bytes):
    return _Unpacker(io.BytesIO(data)).load()


def _read(f) -> bytes | None:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    return data if len(data) == n else None


def _write(f, data: bytes) -> None:
    f.write(_LEN.pack(len(data)))
    f.write(data)
    f.flush()


def reply(model: type[BaseModel], raw: bytes) -> bytes:
    """What the worker sends back for one body: the request, or the exception load_body raised."""
    try:
        return dumps((True, load_body(model, raw)))
    except Exception as exc:  # noqa: BLE001 (raised again in the server)
        try:
            return dumps((False, exc))
        except Exception:  # noqa: BLE001
            return dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server ends it (its stdin closes)
    inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, not into a reply
    while (request := _read(inp)) is not None:
        _write(out, reply(*pickle.loads(request)))


# imports from the server's sys.path (its zipfusion), as multiprocessing's spawn does
WORKER = [sys.executable, "-c", "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from zipfusion.server.body_worker import main; main()"]


class BodyWorker:
    """The worker process, spoken to from one thread of this process (one body at a time). A
    worker found dead is started again; one that dies during a body fails only that request."""

    def __init__(self, command: list[str] | None = None):
        self.command = command or WORKER
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._proc: subprocess.Popen | None = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zipfusion-bodies")
        return self._thread

    def start(self) -> concurrent.futures.Future:
        """Start the worker now rather than on the first large body."""
        return self._executor().submit(self._process)

    def submit(self, model: type[BaseModel], raw: bytes) -> concurrent.futures.Future:
        return self._executor().submit(self.parse, model, raw)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _process(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(self.command + [json.dumps(sys.path)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE)
        return self._proc

    def parse(self, model: type[BaseModel], raw: bytes) -> BaseModel:
        """As load_body(model, raw), in the worker."""
        proc = self._process()
        try:
            _write(proc.stdin, pickle.dumps((model, raw), pickle.HIGHEST_PROTOCOL))
            data = _read(proc.stdout)
        except OSError:  # the pipe broke: the worker is gone
            data = None
        if data is None:
            proc.kill()
            code = proc.wait()
            raise BadRequest(f"the process that parses large request bodies exited (code {code}) while parsing this "
                             "one; it is started again: send the request again", 500)
        ok, value = loads(data)
        if ok:
            return value
        raise value

    def close(self) -> None:
        """End the worker (after the body in progress, if any) and its thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
