"""Per-field value rules: what a setting must be beyond its type, each a function that returns the
requirement a bad value misses (None when the value is fine).

The library's config dataclasses declare theirs once, as ``FIELD_RULES`` (field -> rule), and check
them when built (``check_fields``); the recipe's config applies the same rules under its own dotted
keys (``recipe.config.rules``), so that a bad value fails at load naming the recipe's key. The
vocabulary is here, in the lowest layer, so that every layer above writes its rules with it."""

from typing import Any, Callable, Iterable, Mapping

Rule = Callable[[Any], "str | None"]


def at_least(low: int | float) -> Rule:
    return lambda v: None if v >= low else f"must be >= {low}"


def greater_than(low: float) -> Rule:
    return lambda v: None if v > low else f"must be > {low}"


def one_of(choices: Iterable[str] | Callable[[], Iterable[str]]) -> Rule:
    """A choice rule; a callable is asked at check time (policy losses can be registered later)."""

    def check(value: Any) -> str | None:
        valid = tuple(choices() if callable(choices) else choices)
        values = value if isinstance(value, list) else [value]
        bad = [v for v in values if v not in valid]
        return f"{bad[0]!r} is not a valid choice; choose from {', '.join(valid)}" if bad else None

    return check


def check_fields(obj: Any, rules: Mapping[str, Rule]) -> None:
    """A ``ValueError`` naming the first field of the dataclass ``obj`` whose value breaks its rule;
    a None (an optional setting left unset) is checked by none, as the recipe's loader does."""
    for name, rule in rules.items():
        value = getattr(obj, name)
        problem = None if value is None else rule(value)
        if problem:
            raise ValueError(f"{name}={value!r}: {problem}")
