"""Structured-output constraints compiled before the engine sees them, in worker processes of their own: vLLM compiles
a grammar inside the engine core in a small thread pool that a gone request does not cancel, so one slow schema
holds back every structured request. Here a compile is bounded in time (killed with its process), cancelled with
its request, and its verdict kept per constraint hash. Imports neither vllm nor xgrammar in the gateway's process."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import re
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from engine.types import ConstraintKind as Kind
from engine.types import Verdict

log = logging.getLogger(__name__)


def constraint_key(kind: Kind, spec: str, any_whitespace: bool) -> str:
    return hashlib.sha256(f"{kind}\0{int(any_whitespace)}\0{spec}".encode()).hexdigest()


# --- the worker process ---------------------------------------------------------------------


def _serve(conn: Connection, model: str, vocab_size: int) -> None:  # pragma: no cover (a child process)
    """A worker: load the tokenizer as vLLM's xgrammar backend does, then compile on request."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    stops = set(info.stop_token_ids)
    conn.send(("ready", None))
    while True:
        try:
            kind, spec, any_whitespace = conn.recv()
        except EOFError:
            return
        try:
            compiled = _compile(xgr, compiler, kind, spec, any_whitespace)
            conn.send(("ok", None) if _writable(xgr, compiled, info.vocab_size, stops) else ("error", _EMPTY))
        except Exception as exc:  # xgrammar's RuntimeError carries "[time] file:line: message"
            conn.send(("error", _XGRAMMAR_PREFIX.sub("", str(exc).strip())))


_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")  # "[13:05:47] /project/cpp/x.cc:4944: "
_EMPTY = "it admits no value: the model could write nothing but an empty answer"


def _compile(xgr: Any, compiler: Any, kind: str, spec: str, any_whitespace: bool) -> Any:
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_lark(spec) if "::=" not in spec else compiler.compile_grammar(spec)


def _writable(xgr: Any, compiled: Any, vocab_size: int, stops: set[int]) -> bool:
    """Whether the grammar lets the model write any first token other than the end of the text."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()
    for index, word in enumerate(words):
        bits = word & 0xFFFFFFFF
        while bits:
            low = bits & -bits
            if index * 32 + low.bit_length() - 1 not in stops:
                return True
            bits ^= low
    return False


# --- the gateway's side ---------------------------------------------------------------------


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, model: str, vocab_size: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads (the engine's)
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, model, vocab_size), daemon=True,
                                       name="grammar-compiler")
        self.process.start()
        child.close()
        self.ready = False

    async def receive(self) -> tuple[str, str | None]:
        """The worker's next message; EOFError if it died."""
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: None if readable.done() else readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        message: tuple[str, str | None] = self.conn.recv()
        return message

    def kill(self) -> None:
        self.process.kill()
        self.conn.close()
        self.process.join(timeout=1)


class GrammarCompiler:
    """Compile checks in `workers` processes, with up to `verdicts` kept (LRU). `check` never raises for the
    constraint's sake: it answers a `Verdict`. A compiled grammar that lets the model write nothing but the end of
    the text is refused too."""

    def __init__(self, model: str, vocab_size: int, workers: int = 2, verdicts: int = 4096) -> None:
        self.model, self.vocab_size, self.size = model, vocab_size, workers
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()
        self._max_verdicts = verdicts
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self) -> GrammarCompiler:
        for _ in range(self.size):
            self._spawn()
        return self

    def _spawn(self) -> None:
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._boot(_Worker(self.model, self.vocab_size)))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _boot(self, worker: _Worker) -> None:
        try:
            kind, _ = await worker.receive()
        except (EOFError, OSError):
            log.error("grammar compiler worker died at start (model %s)", self.model)
            worker.kill()
            return
        except asyncio.CancelledError:
            worker.kill()
            raise
        worker.ready = kind == "ready"
        self._idle.put_nowait(worker)

    async def started(self) -> None:
        await asyncio.gather(*list(self._starting), return_exceptions=True)

    def known(self, key: str) -> Verdict | None:
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
        return verdict

    def _keep(self, key: str, verdict: Verdict) -> None:
        self._verdicts[key] = Verdict(verdict.error, verdict.seconds, cached=True)
        while len(self._verdicts) > self._max_verdicts:
            self._verdicts.popitem(last=False)

    async def check(self, kind: Kind, spec: str, any_whitespace: bool, timeout_s: float) -> Verdict:
        """Compile `spec` within `timeout_s` seconds (waiting for a free worker not counted: it is
        bounded by the caller). Cancelling this kills the compile."""
        key = constraint_key(kind, spec, any_whitespace)
        known = self.known(key)
        if known is not None:
            return known
        worker = await self._idle.get()
        started = time.perf_counter()
        try:
            worker.conn.send((kind, spec, any_whitespace))
            status, message = await asyncio.wait_for(worker.receive(), timeout_s)
        except TimeoutError:
            self._replace(worker)
            return Verdict(f"it did not compile within {timeout_s:g} s", timeout_s, timed_out=True)
        except (EOFError, OSError, BrokenPipeError):
            self._replace(worker)
            return Verdict("the grammar compiler failed on it", time.perf_counter() - started)
        except BaseException:  # cancelled: the request ended; its compile ends with it
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        verdict = Verdict(message if status == "error" else None, time.perf_counter() - started)
        self._keep(key, verdict)
        return verdict

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._spawn()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        while not self._idle.empty():
            self._idle.get_nowait().kill()
