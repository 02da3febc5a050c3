"""Engine-neutral pieces of reading a server's answer into a `Sample`: each output token's weight version from the
server's version spans (SGLang and vLLM report the same {"version", "start", "end"} spans, "default" for the weights
a server was launched with), and the rule for a kept set larger than the engine records.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from topp_rl.data.sample import Sample, SampleStatus

LAUNCH_VERSION = "default"  # the weight_version a server reports for the weights it was launched with


def spans_to_versions(
    spans: Sequence[Mapping[str, Any]] | None, tag: str | None, *, num_tokens: int, start_version: int, name: str,
    expects: str,
) -> list[int]:
    """The weight version of each of an answer's `num_tokens` output tokens: from its weight-version `spans`
    ({"version", "start", "end"}, contiguous, from 0 to `num_tokens`), or without spans its `tag` for all; a tag is
    `weight_version_of`. RuntimeError naming `name` (and the server release whose spans `expects` says) when the
    spans do not tile the output."""
    if not spans:
        return [weight_version_of(tag, start_version, name=name)] * num_tokens
    versions: list[int] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise RuntimeError(
                f"{name}: weight version spans {list(spans)} do not tile its {num_tokens} output tokens (span "
                f"[{start}, {end}) after {len(versions)} tokens: a gap or an overlap); this client expects "
                f"{expects} spans"
            )
        versions += [weight_version_of(span["version"], start_version, name=name)] * (end - start)
    if len(versions) != num_tokens:
        raise RuntimeError(
            f"{name}: weight version spans {list(spans)} cover {len(versions)} tokens, not its {num_tokens} output "
            f"tokens; this client expects {expects} spans"
        )
    return versions


def weight_version_of(tag: str | None, start_version: int, *, name: str) -> int:
    """A server's weight_version tag as the trainer's version: the integer this engine pushed, `start_version`
    for the launch weights ("default", or no tag at all)."""
    if tag is None or tag == LAUNCH_VERSION:
        return start_version
    try:
        return int(tag)
    except ValueError:
        raise RuntimeError(
            f"{name}: the server's weight_version {tag!r} is neither {LAUNCH_VERSION!r} nor an integer; its weights "
            "were pushed by something else than this engine (which tags each push with the trainer's version)"
        ) from None


def overflow_sample(prompt: list[int], message: str, *, weight_version: str | None) -> Sample:
    """The rule for a kept set larger than max_candidates: the sample is aborted (never trained on, never cut to
    the cap) and flagged, so the datamodule counts it (`rollout/candidate_overflow_frac`)."""
    return Sample(
        prompt_ids=prompt,
        status=SampleStatus.ABORTED,
        metadata={
            "candidate_overflow": True,
            "finish_reason": {"type": "abort", "message": message},
            "weight_version": weight_version,
        },
    )
