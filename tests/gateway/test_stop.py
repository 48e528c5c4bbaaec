"""Stop strings across token boundaries, with hand-worked expectations."""

from __future__ import annotations

from gateway.stop import StopStringMatcher


def stream(stop: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    matcher = StopStringMatcher(stop)
    released = [matcher.add(p) for p in pieces]
    tail = "" if matcher.stopped else matcher.flush()
    return released, matcher.stopped, "".join(released) + tail


def test_a_stop_string_split_over_three_pieces_is_found_and_not_released() -> None:
    released, stopped, text = stream(["END"], ["Hello E", "N", "D and more"])
    assert stopped
    assert text == "Hello "
    # "E" was held back until "N" and "D" decided it.
    assert released == ["Hello ", "", ""]


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    released, stopped, text = stream(["END"], ["Hello E", "N", "x"])
    assert not stopped
    assert released == ["Hello ", "", "ENx"]
    assert text == "Hello ENx"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    _, stopped, text = stream(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert stopped and text == "hel"


def test_text_after_the_stop_string_in_the_same_piece_is_dropped() -> None:
    _released, stopped, text = stream(["\n\n"], ["line one\n", "\nline two"])
    assert stopped and text == "line one"


def test_without_stop_strings_everything_is_released_at_once() -> None:
    released, stopped, _text = stream([], ["a", "b"])
    assert released == ["a", "b"] and not stopped


def test_held_text_is_flushed_at_the_end() -> None:
    released, stopped, text = stream(["STOP"], ["the end ST"])
    assert released == ["the end "] and text == "the end ST" and not stopped


def test_a_stop_string_at_the_very_start() -> None:
    _, stopped, text = stream(["<"], ["<tag>"])
    assert stopped and text == ""
