"""An answer that runs into the context limit ends with finish_reason "length", however many rejected
drafts its batch group holds (masked, never trimmed): the group compacts before its physical slots
would pass the stages' limit. Found by a new user: 8142 tokens into an 8192-token context, a group
asked stage 0 for slot 8193 and the whole answer ended in a stage failure."""

from __future__ import annotations

import pytest

from tests.conftest import chat, start_coordinator, start_worker, wait_ready

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("draft", ["ngram", "self-int4"])
def test_answer_reaching_the_context_limit_ends_with_length(draft, build_2, tmp_path):
    limit = 160
    workers = [start_worker(build_2, shard, tmp_path, "--max-context", str(limit)) for shard in range(2)]
    peers = [a for _, address in workers for a in ("--peer", address)]
    coordinator, url = start_coordinator(build_2, tmp_path, *peers, "--no-discover", "--draft", draft,
                                         "--spec-k", "4", "--batch-groups", "1", "--max-context", str(limit),
                                         "--inference-precision", "f32", "--compact-min-slots", "100000")
    try:
        wait_ready(url)
        r = chat(url, "Count from one to one hundred in words, one number per line.", max_tokens=10**6,
                 ignore_eos=True)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length", body
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == limit, body["usage"]
        assert body["fleet"]["drafted_tokens"] > body["fleet"]["accepted_tokens"], body["fleet"]  # some rejected
    finally:
        coordinator.stop()
        for proc, _ in workers:
            proc.stop()
