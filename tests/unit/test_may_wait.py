"""What a credit release drains: the capabilities a dispatcher knows may have work waiting."""

from __future__ import annotations

from workers.may_wait import MayWait

ALIASES = {"summarise": "summarize"}


def resolve(capability: str) -> str:
    return ALIASES.get(capability, capability)


def test_a_release_drains_only_what_may_have_work_and_the_aliases_that_name_it() -> None:
    known = MayWait(drains_all=False, resolve=resolve)
    assert known.worth_draining(["summarize", "text.echo"]) == set()
    known.add(["summarise", "text.echo"])
    assert known.worth_draining(["summarize"]) == {"summarise"}
    assert known.worth_draining(["text.echo", "other"]) == {"text.echo"}


def test_a_drain_that_found_the_set_empty_forgets_it_unless_work_was_heard_of_since() -> None:
    known = MayWait(drains_all=False, resolve=resolve)
    known.add(["text.echo"])
    before_read = known.heard(["text.echo"])
    known.add(["text.echo"])  # a park lands between the drain's read and its answer
    known.found_empty("text.echo", before_read)
    assert known.worth_draining(["text.echo"]) == {"text.echo"}
    known.found_empty("text.echo", known.heard(["text.echo"]))
    assert known.worth_draining(["text.echo"]) == set()


def test_a_pruned_capability_parked_for_meanwhile_is_not_forgotten() -> None:
    known = MayWait(drains_all=False, resolve=resolve)
    known.add(["a", "b"])
    before_prune = known.heard()
    known.add(["b"])
    assert known.forget(["a", "b"], before_prune) == ["a"]
    assert known.worth_draining(["a", "b"]) == {"b"}
    assert known.forget(["b"]) == ["b"]  # no snapshot: forgotten whatever was heard
    assert known.worth_draining(["b"]) == set()


def test_on_a_cluster_a_release_drains_all_it_frees() -> None:
    assert MayWait(drains_all=True, resolve=resolve).worth_draining(["x", "y"]) == {"x", "y"}
