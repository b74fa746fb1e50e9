"""Structured outputs: grammar backends (xgrammar, llguidance), the compile pool and cache, per-sequence
matchers and the token bitmask the sampler applies."""

from fastgen.engine.grammar.backend import BACKENDS, GrammarBackend, Matcher, installed, make_backend
from fastgen.engine.grammar.bitmask import allocate_bitmask, apply_bitmask_
from fastgen.engine.grammar.compiler import GrammarCompileError, GrammarCompiler, PendingGrammar
from fastgen.engine.grammar.manager import PreparedGrammar, StructuredOutputManager
from fastgen.engine.grammar.sequence_grammar import GrammarRejected, SequenceGrammar

__all__ = ["BACKENDS", "GrammarBackend", "GrammarCompileError", "GrammarCompiler", "GrammarRejected", "Matcher",
           "PendingGrammar", "PreparedGrammar", "SequenceGrammar", "StructuredOutputManager", "allocate_bitmask", "apply_bitmask_", "installed", "make_backend"]
