"""Property-based tests: generated run configs against the launchers' config check.

The values are generated from the schema itself (``config.GROUPS`` and every registered
method's settings class, each key's ``setting(...)`` declaration), so a key added later is
covered without a change here. For each key, by its type and rules: values it allows (its
choices, numbers inside its range, the strings of such numbers, ``"true"``/``"False"``),
values it refuses (a number outside the range, just past an open bound, another type, a
non-integral float for an int, NaN and infinities, a string that is no number, a choice that
does not exist) and, for free-form strings, any text (only the rules across keys decide).

The target is what both launchers run before anything starts,
``fedfm_flower.simulation.preflight.resolve_config`` on the app's ``pyproject.toml`` (the declared
defaults merged with the overrides, as ``flwr run`` will); a refusal there is the launcher's
exit 2 with ``error: <message>`` on one line (``tests/test_simulation.py`` checks that end to
end, in a subprocess: exit 2, one line, no traceback). The properties:

1. the check returns a config or raises ``PreflightError``, nothing else;
2. a refusal is one line that names the key (one of the keys given, for several);
3. a value its key's rules refuse is never accepted, whatever else is set;
4. an accepted value is the config's value (coerced to the key's type);
5. overrides typed as ``flwr run -c "k=v ..."`` (parsed by Flower's parser) keep 1 and 2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfm_flower.config.experiment import GROUPS
from fedfm_flower.config.schema import toml_value
from fedfm_flower.methods.registry import settings_classes
from fedfm_flower.methods.settings import allowed_values, coerce
from fedfm_flower.simulation.preflight import PreflightError, parse_overrides, resolve_config
from tests.properties import examples

APP = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def defaults_read_once() -> Iterator[None]:
    """``pyproject.toml``'s declared defaults parsed once, not on every example (1.2 ms each);
    ``resolve_config`` is otherwise what the launchers run."""
    from fedfm_flower.simulation import preflight

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(preflight, "app_defaults", functools.cache(preflight.app_defaults))
        yield


def schema_fields() -> dict[str, dataclasses.Field]:
    """Every run-config key and its declaration: the common groups', then each method's."""
    fields = {f.name.replace("_", "-"): f for group in GROUPS for f in dataclasses.fields(group)}
    for kind in settings_classes():
        fields.update({kind.key_of(f.name): f for f in dataclasses.fields(kind)})
    return fields


FIELDS = schema_fields()
KEYS = sorted(FIELDS)
VALID, INVALID, EITHER = "valid", "invalid", "either"  # what the key's own rules say
LETTERS = st.text(alphabet="abcdefghjklmopqrsuvwxyzABCDEFGHJKLMOPQRSUVWXYZ_-", min_size=1)


def _range(field: dataclasses.Field) -> tuple[float, float, bool, bool]:
    """(lo, hi, lo included, hi included) of a numeric key's rules (infinite: no bound)."""
    rules = field.metadata
    lo, hi, lo_in, hi_in = -math.inf, math.inf, True, True
    if rules.get("within") is not None:
        lo, hi = rules["within"]
        opening, closing = rules.get("bounds", "[]")
        lo_in, hi_in = opening == "[", closing == "]"
    if rules.get("positive"):
        lo, lo_in = max(lo, 0), False if lo <= 0 else lo_in
    if rules.get("non_negative"):
        lo, lo_in = (0, True) if lo < 0 else (lo, lo_in)
    return lo, hi, lo_in, hi_in


def _inside(value: float, field: dataclasses.Field) -> bool:
    lo, hi, lo_in, hi_in = _range(field)
    above = value >= lo if lo_in else value > lo
    below = value <= hi if hi_in else value < hi
    return above and below


def values_of(field: dataclasses.Field) -> st.SearchStrategy[tuple[Any, str]]:
    """(value, what the key's own rules say of it) for one key."""
    kind = type(field.default)
    choices = allowed_values(field)
    if kind is bool:
        valid = st.one_of(st.booleans(), st.sampled_from(["true", "false", "TRUE", "False"]))
        invalid = st.one_of(
            st.integers(), st.floats(), LETTERS.filter(lambda s: s.lower() not in ("true", "false"))
        )
        return st.one_of(valid.map(lambda v: (v, VALID)), invalid.map(lambda v: (v, INVALID)))
    if kind is str:
        if choices is None:
            return st.one_of(st.text(max_size=30), st.integers(), st.floats()).map(
                lambda v: (v, EITHER)
            )
        valid = st.sampled_from(choices)
        invalid = st.text(max_size=20).filter(lambda s: s not in choices)
        return st.one_of(valid.map(lambda v: (v, VALID)), invalid.map(lambda v: (v, INVALID)))
    lo, hi, _, _ = _range(field)
    numbers: st.SearchStrategy[Any]
    if kind is int:
        low = None if lo == -math.inf else math.floor(lo) - 3
        high = None if hi == math.inf else math.ceil(hi) + 3
        numbers = st.one_of(
            st.integers(low, high),
            st.integers(),
            st.integers(low, high).map(float),  # an integral float is an int
            st.integers(low, high).map(str),
        )
        wrong = st.one_of(
            st.booleans(),
            st.integers(-(10**6), 10**6).map(lambda i: i + 0.5),
            st.sampled_from([math.nan, math.inf, -math.inf]),
            LETTERS,
        )
    else:
        low = None if lo == -math.inf else lo - 1
        high = None if hi == math.inf else hi + 1
        bounds = [b for b in (lo, hi) if math.isfinite(b)]
        numbers = st.one_of(
            st.floats(low, high, allow_nan=False),
            st.sampled_from(bounds or [0.0]).flatmap(
                lambda b: st.sampled_from(
                    [b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf)]
                )
            ),
            st.integers(-(10**6), 10**6),
            st.floats(low, high, allow_nan=False).map(repr),
        )
        wrong = st.one_of(st.booleans(), LETTERS, st.sampled_from(["nan", "inf", "-inf"]))
    return st.one_of(
        numbers.map(lambda v: (v, _numeric_verdict(v, kind, field))),
        wrong.map(lambda v: (v, INVALID)),
    )


def _numeric_verdict(value: Any, kind: type, field: dataclasses.Field) -> str:
    """Whether a number (or its string) fits ``field``'s type and range."""
    number = float(value)
    if not math.isfinite(number) or (kind is int and not number.is_integer()):
        return INVALID
    exact = int(value) if kind is int else number
    return VALID if _inside(exact, field) else INVALID


VALUES = {key: values_of(field) for key, field in FIELDS.items()}


@st.composite
def overrides(draw: Any, max_keys: int = 4) -> dict[str, tuple[Any, str]]:
    """1 to ``max_keys`` keys of the schema with generated values and their verdicts."""
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=max_keys, unique=True))
    return {key: draw(VALUES[key]) for key in keys}


def check(given_values: dict[str, Any], verdicts: dict[str, str]) -> None:
    """Properties 1-4 for one set of overrides."""
    try:
        config = resolve_config(APP, given_values)
    except PreflightError as err:
        message = str(err)
        assert "\n" not in message and message.strip(), message
        assert any(key in message for key in given_values), message
        return
    assert INVALID not in verdicts.values(), (given_values, verdicts)
    resolved = config.to_run_config()
    for key, value in given_values.items():
        if key in ("output-dir", "cache-dir", "data-dir", "weights-file", "client-state-dir"):
            continue  # made absolute under the app directory
        assert resolved[key] == coerce(key, value, type(FIELDS[key].default)), key


@pytest.mark.parametrize("key", KEYS)
@settings(max_examples=examples(12))
@given(data=st.data())
def test_each_key_alone_is_accepted_or_refused_in_one_line_naming_it(
    key: str, data: st.DataObject
) -> None:
    value, verdict = data.draw(VALUES[key], label=key)
    check({key: value}, {key: verdict})


@settings(max_examples=examples(1500))
@given(chosen=overrides())
def test_several_keys_are_accepted_or_refused_in_one_line_naming_one(
    chosen: dict[str, tuple[Any, str]],
) -> None:
    check(
        {k: v for k, (v, _) in chosen.items()}, {k: verdict for k, (_, verdict) in chosen.items()}
    )


UNKNOWN_KEYS = st.text(min_size=1, max_size=20).filter(lambda k: k not in FIELDS)


@settings(max_examples=examples(200))
@given(chosen=overrides(max_keys=2), unknown=UNKNOWN_KEYS, value=st.integers())
def test_an_unknown_key_is_refused_by_name(
    chosen: dict[str, tuple[Any, str]], unknown: str, value: int
) -> None:
    given_values = {**{k: v for k, (v, _) in chosen.items()}, unknown: value}
    with pytest.raises(PreflightError, match="unknown run-config key") as refused:
        resolve_config(APP, given_values)
    assert unknown in str(refused.value)


@settings(max_examples=examples(500))
@given(chosen=overrides(), raw=st.booleans())
def test_overrides_typed_on_the_command_line_are_accepted_or_refused_in_one_line(
    chosen: dict[str, tuple[Any, str]], raw: bool
) -> None:
    """``flwr run -c "k=v ..."`` as Flower parses it: each value written as TOML (``raw``:
    as the generated text itself, unquoted, as a user might type it)."""
    pairs = [
        f"{key}={value if raw and isinstance(value, str) else toml_value(value)}"
        for key, (value, _) in chosen.items()
    ]
    item = " ".join(pairs)
    try:
        given_values = parse_overrides([item], APP)
        resolve_config(APP, given_values)
    except PreflightError as err:
        message = str(err)
        assert "\n" not in message and message.strip(), message
        assert any(key in message for key in chosen), message
