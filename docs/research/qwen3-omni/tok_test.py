import torch, time
torch.set_num_threads(1)
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("/tmp/omni-research/tiny-omni")
print(type(tok).__name__, "len", len(tok), "audio_token", tok.audio_token, "image_token", tok.image_token)
msgs = [{"role": "system", "content": "You are a helper."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, world"}]}]
text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
print(repr(text))
enc = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_tensors="pt", return_dict=True)
ids = enc["input_ids"]; print("ids", ids.tolist())
print("decode", repr(tok.decode(ids[0])))
from transformers import Qwen3OmniMoeForConditionalGeneration
m = Qwen3OmniMoeForConditionalGeneration.from_pretrained("/tmp/omni-research/tiny-omni").eval()
torch.manual_seed(0); t = time.time()
tr, wav = m.generate(input_ids=ids, attention_mask=enc["attention_mask"], return_audio=True, speaker="Chelsie",
                     thinker_max_new_tokens=6, talker_max_new_tokens=30)
print("gen_s %.2f" % (time.time() - t), "thinker new", tr.sequences[0, ids.shape[1]:].tolist(), "wav", tuple(wav.shape))
print("decoded new text", repr(tok.decode(tr.sequences[0, ids.shape[1]:])))
# processor
try:
    from transformers import Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    ip = Qwen2VLImageProcessor()
    print("image processor ok")
except Exception as e:
    print("image processor FAILED:", type(e).__name__, str(e)[:300])
try:
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    vp = Qwen2VLVideoProcessor(); print("video processor ok")
except Exception as e:
    print("video processor FAILED:", type(e).__name__, str(e)[:300])
try:
    proc = Qwen3OmniMoeProcessor(image_processor=ip, video_processor=vp, feature_extractor=WhisperFeatureExtractor(feature_size=128),
                                 tokenizer=tok, chat_template=tok.chat_template)
    proc.save_pretrained("/tmp/omni-research/tiny-omni-processor")
    from transformers import AutoProcessor
    p2 = AutoProcessor.from_pretrained("/tmp/omni-research/tiny-omni-processor")
    out = p2.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    print("processor apply_chat_template ids", out["input_ids"].tolist())
except Exception as e:
    print("processor FAILED:", type(e).__name__, str(e)[:400])
