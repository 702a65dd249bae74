"""A test double for a runner: speaks the real runner protocol (runners.protocol.serve)
and writes toy results, and misbehaves on request, so the tester's failure handling can
be tested without an engine. FAKE_RUNNER_CRASH_AFTER=k exits hard after k segments;
FAKE_RUNNER_HANG_AFTER=k goes silent; it always prints junk to stdout the way libraries do."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toy import toy_codes, toy_result  # noqa: E402

from difftest.results import ResultStore, write_result  # noqa: E402
from runners.protocol import serve  # noqa: E402

print("banner: a library printing to stdout at import")  # must not reach the protocol channel
done = 0


def generate(job, emit):
    global done
    for seg in job["segments"]:
        if done == int(os.environ.get("FAKE_RUNNER_CRASH_AFTER", -1)):
            print("fake runner: crashing now", file=sys.stderr)
            os._exit(9)
        if done == int(os.environ.get("FAKE_RUNNER_HANG_AFTER", -1)):
            time.sleep(3600)
        print("noise in the middle of a job")
        if not seg["text"].strip():
            emit("error", segment=seg["id"], kind="bad_input", message="empty text")
            continue
        r = toy_result(seg["id"], toy_codes(5, done), toy_codes(3, 100 + done), segment_hash=seg["hash"])
        side = write_result(ResultStore.stem(Path(job["out_dir"]), seg["id"], seg["hash"]), r)
        emit("result", segment=seg["id"], path=str(side), cached=False, seconds=0.0, audio_seconds=r.seconds)
        done += 1


sys.exit(serve({"generate": generate}, {"label": "fake", "fingerprint": {"engine": "fake"}, "provenance": {}}))
