"""Whether a compiled grammar has a finite output at all.

xgrammar compiles a JSON schema whose `$ref`s form a cycle with no way out (`{"$ref": "#"}`
as a required property, or two definitions that refer to each other) into a grammar whose root
never ends: every derivation refers back to itself. A request under it can only run to
max_tokens or, where nothing at all is allowed, stop on a forbidden token. Such a grammar is
refused before the request is queued.

The check is the classic one for context-free grammars: a rule is productive when one of its
alternatives is a sequence of terminals and productive rules (an optional or starred part needs
nothing); the output is finite when the root is productive. It reads xgrammar's printed,
normalized grammar (`root ::= (("a" x) | ("b")) (=(lookahead))`). A construct it does not know
counts as a terminal, so an unfamiliar grammar is never refused by mistake.
"""

from __future__ import annotations

import re

# A string literal, a character class (with its escapes) or a built-in call such as
# Regex("...", json_string=true), all terminals; a lookahead "(=" whose group produces nothing;
# a rule name; and the operators.
_TOKEN = re.compile(
    r"""\s*(?:
        (?P<terminal>"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\])
      | (?P<call>[A-Z][A-Za-z]*\()
      | (?P<lookahead>\(=)
      | (?P<rule>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<repeat>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
      | (?P<op>[()|*+?])
    )""",
    re.VERBOSE,
)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')
_NAME = re.compile(r"[A-Za-z_]")


def has_finite_output(grammar_text: str, root: str = "root") -> bool:
    """Whether the printed grammar's `root` derives some finite string."""
    rules: dict[str, tuple] = {}
    productive: set[str] = set()
    for line in grammar_text.splitlines():
        name, sep, body = line.partition(" ::= ")
        if not sep:
            continue
        # Literals are terminals: emptied first, in one pass of the regex engine, so that a rule
        # of literals only (a 100,000-member enum) is known productive without being parsed.
        body = _LITERAL.sub('""', body)
        if _NAME.search(body) is None:
            productive.add(name.strip())
        else:
            rules[name.strip()] = _parse(body)
    if root in productive or root not in rules:
        return True
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in productive and _produces(body, productive):
                productive.add(name)
                changed = True
    return root in productive


# An expression is ("alt", [sequences]), a sequence a list of items; an item is ("term",),
# ("rule", name), ("group", alt) and optionally wrapped as ("optional", item) or
# ("repeat", item) (one or more).
def _parse(body: str) -> tuple:
    tokens = _tokens(body)
    alternatives, _ = _alternatives(tokens, 0)
    return alternatives


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:  # something new: a terminal, whatever it is
            tokens.append(("terminal", text[pos]))
            pos += 1
            continue
        kind = match.lastgroup
        if kind in ("call", "lookahead"):
            end = _close(text, match.end())
            if kind == "call":
                tokens.append(("terminal", text[match.start() : end]))
            pos = end
            continue
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


def _close(text: str, pos: int) -> int:
    """The index past the parenthesis that closes the one opened just before `pos`."""
    depth = 1
    while pos < len(text) and depth:
        string = _STRING.match(text, pos)
        if string is not None:
            pos = string.end()
            continue
        depth += {"(": 1, ")": -1}.get(text[pos], 0)
        pos += 1
    return pos


def _alternatives(tokens: list, pos: int) -> tuple[tuple, int]:
    sequences = []
    sequence: list = []
    while pos < len(tokens):
        kind, value = tokens[pos]
        if kind == "op" and value == ")":
            break
        if kind == "op" and value == "|":
            sequences.append(sequence)
            sequence = []
            pos += 1
            continue
        if kind == "op" and value == "(":
            inner, pos = _alternatives(tokens, pos + 1)
            item: tuple = ("group", inner)
            pos += 1  # the ")"
        elif kind == "rule":
            item, pos = ("rule", value), pos + 1
        elif kind == "op":  # a quantifier on the item before it
            if sequence:
                sequence[-1] = _quantified(sequence[-1], value)
            pos += 1
            continue
        elif kind == "repeat":
            if sequence:
                minimum = int(value.strip("{}").split(",")[0])
                sequence[-1] = _quantified(sequence[-1], "*" if minimum == 0 else "+")
            pos += 1
            continue
        else:
            item, pos = ("term",), pos + 1
        sequence.append(item)
    sequences.append(sequence)
    return ("alt", sequences), pos


def _quantified(item: tuple, quantifier: str) -> tuple:
    return ("repeat", item) if quantifier == "+" else ("optional", item)


def _produces(expression: tuple, productive: set[str]) -> bool:
    kind = expression[0]
    if kind == "alt":
        return any(all(_produces(i, productive) for i in seq) for seq in expression[1])
    if kind == "term" or kind == "optional":
        return True
    if kind == "rule":
        return expression[1] in productive
    return _produces(expression[1], productive)  # a group, or one-or-more of an item
