"""Every family under every decoding strategy decodes what the recorded engine decoded (recorded_outputs.py):
the same tokens, text, finish reasons and forward passes, or the same refusal.

The one difference allowed: a request that a stop string ends may take one forward more than recorded, since
stop strings are matched on the text, which is made apart from the step that commits the tokens."""
import json

from recorded_outputs import RECORD, outputs


def test_every_family_and_strategy_decodes_as_recorded(tmp_path):
    recorded = json.loads(RECORD.read_text())
    today = outputs(tmp_path)
    assert sorted(today) == sorted(recorded)
    for key, expected in recorded.items():
        got = today[key]
        if "refused" in expected:
            assert got == expected, key
            continue
        assert "requests" in got, f"{key}: {got}"
        for index, (want, have) in enumerate(zip(expected["requests"], got["requests"], strict=True)):
            where = f"{key}, request {index}"
            if "refused" in want:
                assert have == want, where
                continue
            assert {k: have[k] for k in ("token_ids", "text", "finish_reason")} == \
                {k: want[k] for k in ("token_ids", "text", "finish_reason")}, where
            stopped_by_string = want["finish_reason"] == "FinishReason.STOP" and index == 3
            allowed = {want["nfe"], want["nfe"] + 1} if stopped_by_string else {want["nfe"]}
            assert have["nfe"] in allowed, f"{where}: nfe {have['nfe']}, recorded {want['nfe']}"
