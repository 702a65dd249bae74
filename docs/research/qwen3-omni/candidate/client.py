"""POST /v1/chat/completions with modalities text+audio to the tiny Qwen3-Omni server; save WAVs; print stats.
usage: client.py PORT OUTDIR [N_CONCURRENT] [--body-extra JSON]"""
import base64, concurrent.futures as cf, hashlib, io, json, sys, time, urllib.request, wave
import numpy as np
port, out = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 1
extra = json.loads(sys.argv[sys.argv.index("--body-extra") + 1]) if "--body-extra" in sys.argv else {}
tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv else "req"
import os; os.makedirs(out, exist_ok=True)
def one(i):
    body = {"model": "/tmp/omni-cand/tiny-omni", "messages": [{"role": "user", "content": "Hello, world."}],
            "modalities": ["text", "audio"], "speaker": "Ethan", "max_tokens": 8, "temperature": 0.0}
    body.update(extra)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.time()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            resp = json.loads(r.read()); code = r.status
    except urllib.error.HTTPError as e:
        return {"i": i, "status": e.code, "err": e.read().decode()[:1500], "s": round(time.time() - t, 2)}
    dt = time.time() - t
    res = {"i": i, "status": code, "s": round(dt, 2), "n_choices": len(resp.get("choices", []))}
    for ch in resp["choices"]:
        m = ch["message"]
        if m.get("audio"):
            raw = base64.b64decode(m["audio"]["data"])
            p = f"{out}/{tag}-{i}.wav"; open(p, "wb").write(raw)
            w = wave.open(io.BytesIO(raw)); fr = w.readframes(w.getnframes())
            a = np.frombuffer(fr, dtype=np.int16)
            res.update(wav=p, sr=w.getframerate(), ch=w.getnchannels(), samples=w.getnframes(),
                       pcm_sha=hashlib.sha256(fr).hexdigest()[:16], absmax=int(np.abs(a).max()) if a.size else 0,
                       std=float(a.std()) if a.size else 0.0, finish=ch.get("finish_reason"))
        else:
            res.update(text=repr(m.get("content"))[:80], text_finish=ch.get("finish_reason"))
    res["usage"] = resp.get("usage")
    return res
t0 = time.time()
with cf.ThreadPoolExecutor(n) as ex:
    for r in ex.map(one, range(n)):
        print(json.dumps(r))
print(json.dumps({"wall_s": round(time.time() - t0, 2), "n": n}))
