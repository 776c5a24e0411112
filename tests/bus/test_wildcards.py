"""NATS subject syntax: validation and wildcard matching as the in-memory bus applies them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import InvalidName
from bus.wildcards import subject_matches, validate_key, validate_subject

token = st.text(alphabet="abcxyz019_-", min_size=1, max_size=4)
subjects = st.lists(token, min_size=1, max_size=5).map(".".join)


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.*.c", "a.b.c", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        (">", "a", True),
        ("*.*", "a.b", True),
        ("*", "a.b", False),
        ("a.b", "a.b.c", False),
        ("a.b.c", "a.b", False),
        ("shoal.load.*", "shoal.load.i1", True),
        ("shoal.ev.>", "shoal.load.i1", False),
    ],
)
def test_subject_matches_follows_nats_rules(pattern: str, subject: str, matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


@settings(max_examples=150, deadline=None)
@given(subjects, st.data())
def test_wildcards_replacing_tokens_still_match(subject: str, data: st.DataObject) -> None:
    tokens = subject.split(".")
    starred = [t if not data.draw(st.booleans()) else "*" for t in tokens]
    assert subject_matches(".".join(starred), subject)
    cut = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    assert subject_matches(".".join([*tokens[:cut], ">"]), subject)
    assert not subject_matches(".".join([*tokens, ">"]), subject)
    assert not subject_matches(subject + ".x", subject)


@pytest.mark.parametrize("bad", ["", "a..b", ".a", "a.", "a b", "a.>.b", "a.b*"])
def test_invalid_subjects_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidName):
        validate_subject(bad, wildcards=True)


def test_wildcards_only_where_allowed_and_keys_follow_kv_rules() -> None:
    with pytest.raises(InvalidName):
        validate_subject("a.*")
    assert validate_subject("a.*", wildcards=True) == "a.*"
    assert validate_key("snapshot/v1=ok.part-2_x") == "snapshot/v1=ok.part-2_x"
    for bad in ("a b", "a..b", ".a", "a.", "a*", "ü"):
        with pytest.raises(InvalidName):
            validate_key(bad)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab.*> \t\n\xa0é", max_size=8), st.booleans())
def test_the_fast_path_accepts_and_rejects_exactly_what_the_token_rules_do(
    subject: str, wildcards: bool
) -> None:
    from bus.wildcards import _validate_tokens

    def outcome(check: object) -> str:
        try:
            return str(check(subject, wildcards=wildcards))  # type: ignore[operator]
        except InvalidName as exc:
            return f"error: {exc}"

    assert outcome(validate_subject) == outcome(_validate_tokens)
