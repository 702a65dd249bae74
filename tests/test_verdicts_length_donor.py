"""The length donor: the vocoder got the segment's own reference codes, cut or extended to a
co-batched request's length (vLLM-Omni's no-async hand-off, docs/handoff-probe.md finding 3)."""

import numpy as np
import pytest
from toy import toy_codes, toy_decode, toy_evidence, toy_result

from difftest.records.report import build_report, summary_lines, summary_markdown
from difftest.verdicts.classify import Evidence, classify

CODES = toy_codes(40, 1)
OWN = toy_codes(20, 2)  # this segment's reference codes
PEERS = {"b": toy_codes(15, 3), "c": toy_codes(12, 4), "d": toy_codes(21, 5), "x": np.zeros((0, 16), np.int64)}


def grown(ref, n):  # the hand-off's concatenated copies, trimmed to n frames
    return np.concatenate([ref, ref, ref])[:n]


def ev(used, own=OWN, peers=PEERS, control=True, cross=True, donors=True):
    """Segment a at concurrency N handed `used` as reference codes; its own are `own`."""
    ctrl = toy_result("a", CODES, own) if control else None
    cross_donors = {p: toy_result("a", CODES, rc) for p, rc in peers.items() if len(rc)} if donors else {}
    return toy_evidence(toy_result("a", CODES, used), codes=CODES, own=own, cross=cross, control=ctrl,
                        cross_donors=cross_donors, peer_ref_codes=dict(peers))


def test_cut_to_a_peers_length_names_it(policy):
    v = classify(ev(OWN[:15]), policy)
    assert (v.verdict, v.donor, v.donor_kind, v.stage, v.first_divergent_frame, v.first_divergent_chunk) == (
        "contamination", "b", "length", "handoff", 0, 0)
    assert v.summary.startswith("a's vocoder got its own reference codes cut to b's length "
                                "(15 frames instead of 20: its last 5 dropped), as if handed b's ref_code_len")
    assert "its audio leaves the decode with its own reference in chunks 0-1" in v.summary
    assert v.comparisons["ref_codes"]["own_resized"] == "cut"
    assert v.comparisons["ref_codes"]["peers_of_that_length"] == ["b"]
    assert v.to_json()["donor_kind"] == "length"
    assert any("vocoder_defect" in n for n in v.notes)  # the audio route agrees something is off


def test_extended_to_a_peers_length_names_it(policy):
    # The 0.30.0 finding: 21 frames (its first frame again at the end) instead of 20.
    v = classify(ev(grown(OWN, 21)), policy)
    assert (v.verdict, v.donor, v.donor_kind, v.stage, v.first_divergent_chunk) == (
        "contamination", "d", "length", "handoff", 0)
    assert "extended to d's length (21 frames instead of 20: 1 more repeating it from its start)" in v.summary


def test_named_without_control_or_cross_decode(policy):
    # Own codes from the reference engine; no audio evidence: the onset is where the prefix ends.
    v = classify(ev(OWN[:12], control=False, cross=False), policy)
    assert (v.verdict, v.donor, v.donor_kind, v.first_divergent_frame, v.first_divergent_chunk) == (
        "contamination", "c", "length", 0, 0)
    assert v.comparisons["ref_codes"]["own_from"] == "reference"
    assert "its audio" not in v.summary


def test_codes_donor_keeps_its_kind(policy):
    v = classify(ev(PEERS["c"]), policy)
    assert (v.verdict, v.donor, v.donor_kind) == ("contamination", "c", "codes")
    leaked = toy_result("a", CODES, OWN, wav=toy_decode(CODES, PEERS["b"]))
    v = classify(Evidence(segment_id="a", reference=toy_result("a", CODES, OWN), candidate=leaked,
                          control=toy_result("a", CODES, OWN),
                          cross_own=toy_result("a", CODES, OWN), cross_donors={"b": toy_result("a", CODES, PEERS["b"])},
                          peer_ref_codes={"b": PEERS["b"]}),
                 policy)
    assert (v.verdict, v.donor, v.donor_kind) == ("contamination", "b", "codes")  # the audio route


@pytest.mark.parametrize("used, own, peers, why", [
    # The lengths agree: a 20-frame reference that is not its own is not a resize.
    (np.roll(OWN, 1, axis=0), OWN, {**PEERS, "e": toy_codes(20, 6)}, None),
    # An x-vector clone has no reference codes of its own.
    (toy_codes(15, 8), np.zeros((0, 16), np.int64), PEERS, None),
    # No peer has that length.
    (OWN[:17], OWN, PEERS, "a length no co-batched request's reference codes have"),
    # Its own codes then a frame that is not its own start: not what the hand-off makes.
    (np.concatenate([OWN, PEERS["b"][:1]]), OWN, PEERS, None),
])
def test_no_length_donor(policy, used, own, peers, why):
    v = classify(ev(used, own, peers), policy)
    assert v.donor is None and v.donor_kind is None and v.verdict != "contamination"
    notes = [n for n in v.notes if "no single donor" in n or "no co-batched" in n]
    if why:
        assert len(notes) == 1 and why in notes[0] and "its own reference codes cut to" in notes[0]
    else:
        assert not notes


def test_a_length_two_peers_share_is_a_handoff_defect_naming_both(policy):
    v = classify(ev(OWN[:15], OWN, {**PEERS, "b2": toy_codes(15, 7)}), policy)
    assert (v.verdict, v.stage, v.donor) == ("handoff_defect", "handoff", None)
    assert ("a's vocoder got its own reference codes cut to 15 frames (instead of 20: its last 5 dropped), as if "
            "handed the ref_code_len of b or b2, whose reference codes all have that length (the #4421 family; "
            "no single donor)") in v.summary


def test_report_shows_the_kind(policy):
    v = classify(ev(OWN[:15]), policy)
    rep = build_report([v], policy)
    assert rep["segments"][0]["donor_kind"] == "length" and rep["segments"][0]["donor"] == "b"
    assert "a: contamination [chunk 0, handoff, donor b (length)] a's vocoder" in "\n".join(summary_lines(rep))
    assert "| a | contamination | 0 | handoff | b (length) |" in summary_markdown(rep)


def test_the_real_vllm_omni_0_30_0_wave(policy):
    """Reference codes captured from vLLM-Omni 0.30.0 on CPU (voice-clone-concurrency at 4, the wave
    mixing an x-vector clone with in-context ones; docs/vllm-omni.md): vcc-17 (own 32 frames) got 33,
    vcc-20 (own 33) got 35. Each is its own reference extended to a co-batched request's length."""
    from pathlib import Path

    data = np.load(Path(__file__).with_name("data") / "vllm-omni-0.30.0-mixed-wave-ref-codes.npz")
    wave = sorted({k.split(".", 1)[1] for k in data.files})
    found = {}
    for sid in wave:
        own, used = data[f"c1.{sid}"], data[f"c4.{sid}"]
        peers = {p: data[f"c1.{p}"] for p in wave if p != sid}
        e = Evidence(segment_id=sid, reference=toy_result(sid, CODES, own), candidate=toy_result(sid, CODES, used),
                     control=toy_result(sid, CODES, own),
                     cross_own=None, cross_donors={}, peer_ref_codes=peers)
        v = classify(e, policy)
        found[sid] = (v.verdict, v.donor, v.donor_kind)
    assert found["vcc-17-zh-cross-lingual"] == ("contamination", "vcc-20-auto", "length")
    assert found["vcc-20-auto"] == ("contamination", "vcc-19-fr-short-unaligned", "length")
    assert found["vcc-18-es-long-xvector"][1] is None and found["vcc-19-fr-short-unaligned"][1] is None
