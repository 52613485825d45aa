"""A replica's grammar compiler: each request's grammar state is built on a thread of its own,
never the engine's (a complex schema takes a while), from a cache of validated grammars."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from models.grammar import GrammarCompiler
from models.request import Request
from models.spec import ModelSpec
from models.tokenizer import Tokenizer


class ReplicaGrammars:
    def __init__(self, target: ModelSpec) -> None:
        self._target = target
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use: a replica never asked for a grammar never loads llguidance."""
        with self._lock:
            if self._compiler is None:
                cfg = self._target.config()
                tok = Tokenizer(Path(self._target.folder))
                # masks span the larger of the two: a test model may cut the vocabulary short
                vocab = max(cfg.vocab_size, tok.vocab_size)
                self._compiler = GrammarCompiler(tok.hf, vocab, cfg.eos_token_ids)
            return self._compiler

    def attach(self, req: Request) -> None:
        """Gives ``req`` (and so its choices) its grammar state; raises ``GrammarError``."""
        spec = req.sampling.grammar
        if spec is not None and req.grammar is None:
            req.grammar = self.compiler.state(spec)

    async def prepare(self, req: Request) -> None:
        if req.sampling.grammar is not None and req.grammar is None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.attach, req)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
