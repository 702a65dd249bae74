"""The model family's numbers live in difftest/family.py only (issue 59, item 2): every module of the
tester, the runners and the dashboard is read as Python tokens (comments and strings aside), and
none writes the codec's numbers (codebooks, codebook size, sample rate, samples a frame, frame rate,
stop id) except where the same number means something else, listed here with what it means."""

import io
import json
import tokenize
from collections import Counter
from pathlib import Path

from reference_support import tiny  # noqa: F401  (a fixture)

from difftest import family
from difftest.family import FAMILIES, QWEN3_OMNI, QWEN3_TTS

REPO = Path(__file__).resolve().parents[1]
READ = ("difftest", "runners", "dashboards")

# (module, number) -> how often, and what the number is there
NOT_THE_CODEC = {
    ("difftest/engines/deploy_diff.py", "16"): (1, "how deep a deploy file's base_config may nest"),
    ("difftest/engines/http.py", "16"): (1, "the bits of a PCM answer"),
    ("difftest/engines/vllm_omni.py", "2048"): (2, "vLLM-Omni's stage-0 token budget and the talker's max_model_len"),
    ("difftest/engines/omni_chat.py", "2048"): (3, "Qwen3-Omni's thinker and talker max_model_len, the talker's budget"),
    ("difftest/commands/run_matrix.py", "16"): (1, "the most cells a matrix may have"),
    ("difftest/repro/standalone.py", "16"): (1, "16-bit PCM, in the stdlib-only repro.py"),
    ("difftest/commands/selfcheck.py", "1920"): (1, "the talker tokens of the sampled-power variant, a count"),
    ("difftest/suites/voices.py", "16"): (1, "the fewest PCM bits a voice may have"),
    ("difftest/suites/wavio.py", "16"): (6, "a WAV's fmt chunk size, 16-bit PCM, a 24-bit sample's top byte"),
    ("runners/reference/service.py", "16"): (1, "the shortest segment hash a request may carry"),
    ("runners/reference/tiny_checkpoint.py", "16"): (10, "the tiny checkpoint's model widths"),
    ("runners/reference_omni/tiny_checkpoint.py", "16"): (1, "the tiny Qwen3-Omni's vision patch size"),
    ("dashboards/media.py", "16"): (1, "16-bit PCM"),
    ("dashboards/pages.py", "16"): (1, "pixels"),
}


def codec_numbers(f: family.ModelFamily) -> set[str]:
    frame_rate = f.sample_rate / f.samples_per_frame
    return {str(n) for n in (f.codebooks, f.codebook_size, f.sample_rate, f.samples_per_frame, f.stop_id, frame_rate)}


def numbers_written(numbers: set[str], repo: Path = REPO) -> Counter:
    """(module, number) -> occurrences as a Python number token, outside difftest/family.py. A hash
    prefix (`[:16]`) and a byte size (`16 << 20`, `1 << 16`) are no codec number."""
    found = Counter()
    for root in READ:
        for path in sorted((repo / root).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            if rel == "difftest/family.py":
                continue
            toks = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                    if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
            for i, t in enumerate(toks):
                if t.type != tokenize.NUMBER or t.string.replace("_", "") not in numbers:
                    continue
                before = [x.string for x in toks[max(0, i - 2):i]]
                after = toks[i + 1].string if i + 1 < len(toks) else ""
                if before == ["[", ":"] or "<<" in (after, before[-1:] and before[-1]):
                    continue
                found[(rel, t.string)] += 1
    return found


def test_no_module_but_the_family_writes_the_codec_numbers():
    found = numbers_written(codec_numbers(QWEN3_TTS))
    unexplained = {k: n for k, n in found.items() if k not in NOT_THE_CODEC}
    assert not unexplained, ("the family's numbers, written outside difftest/family.py (read them from "
                             f"difftest.family, or list what the number means here): {unexplained}")
    moved = {k: (found.get(k, 0), n) for k, (n, _) in NOT_THE_CODEC.items() if found.get(k, 0) != n}
    assert not moved, f"(module, number): (found, listed) no longer match: {moved}"


def test_the_scan_sees_a_codec_number_where_one_is_written(tmp_path):
    """The test above can fail: a module writing 1920 is found, a comment or string saying it is not."""
    (tmp_path / "difftest").mkdir()
    (tmp_path / "difftest" / "m.py").write_text('x = n // 1920  # 1920\ny = "24000"\nz = h[:16] + [0] * 16\n')
    assert numbers_written(codec_numbers(QWEN3_TTS), tmp_path) == Counter({("difftest/m.py", "1920"): 1, ("difftest/m.py", "16"): 1})


def test_qwen3_tts_is_the_codec_the_tests_measure():
    """The record's values, against what the reference's tiny checkpoint is built with (a test reads
    them independently) and what the speech API names."""
    f = QWEN3_TTS
    assert (f.codebooks, f.codebook_size, f.sample_rate, f.samples_per_frame, f.stop_id) == (16, 2048, 24000, 1920, 2150)
    assert f.frame_seconds == 0.08 and f.sample_rate / f.samples_per_frame == 12.5
    assert dict(f.tasks) == {"voice_clone": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}
    assert f.serving_stages == ("talker", "vocoder") and f.stages[0] == "talker_input" and f.stages[-1] == "vocoder"
    assert FAMILIES == {"qwen3-tts": f, "qwen3-omni": QWEN3_OMNI} and family.FAMILY is f
    assert (family.CODEBOOKS, family.SAMPLE_RATE, family.SAMPLES_PER_FRAME, family.STOP_ID) == (16, 24000, 1920, 2150)


def test_qwen3_omni_speaks_the_same_codec_through_three_stages():
    """Qwen3-Omni's talker is Qwen3-TTS's codec (tests/test_reference_omni.py measures its tiny build's
    audio: 1920 samples a frame at 24 kHz); its request is a chat turn, served by thinker, talker, code2wav."""
    o, t = QWEN3_OMNI, QWEN3_TTS
    assert (o.codebooks, o.codebook_size, o.sample_rate, o.samples_per_frame, o.stop_id) == \
        (t.codebooks, t.codebook_size, t.sample_rate, t.samples_per_frame, t.stop_id)
    assert dict(o.tasks) == {"chat": "chat"} and dict(o.task_inputs) == {"chat": "speaker"}
    assert o.serving_stages == ("thinker", "talker", "code2wav") and o.stages[0] == "thinker"
    assert o.reference_runner == "runners.reference_omni" and o.tiny == ("tiny-omni",)
    assert {f.reference_label for f in FAMILIES.values()} == {"qwen-tts", "transformers-qwen3-omni"}


def test_the_tiny_checkpoint_is_built_from_the_record(tiny):
    """The seeded tiny checkpoint the builder writes carries the record's codec (its config files)."""
    f = QWEN3_TTS
    for t in ("base", "custom_voice", "voice_design"):
        talker = json.loads((tiny / t / "config.json").read_text())["talker_config"]
        assert talker["num_code_groups"] == f.codebooks and talker["codec_eos_token_id"] == f.stop_id
        assert talker["code_predictor_config"]["vocab_size"] == f.codebook_size
        codec = json.loads((tiny / t / "speech_tokenizer" / "config.json").read_text())
        assert codec["decode_upsample_rate"] == codec["encode_downsample_rate"] == f.samples_per_frame
        assert codec["output_sample_rate"] == codec["input_sample_rate"] == f.sample_rate
        assert codec["decoder_config"]["num_quantizers"] == f.codebooks
