"""Structured outputs: grammars compiled by xgrammar, per-request matchers, step bitmasks."""
