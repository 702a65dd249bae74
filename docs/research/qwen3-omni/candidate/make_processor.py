"""Add a Qwen3OmniMoeProcessor (feature extractor, image and video processors) to the tiny checkpoint.
vLLM's thinker multimodal processor loads it at start (qwen3_omni_moe_thinker.py:655-675).
Run with .venv-vllm-omni/bin/python (has Pillow + torchvision)."""
import sys, os
from transformers import (AutoTokenizer, WhisperFeatureExtractor, Qwen2VLImageProcessor)
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor
try:
    from transformers import Qwen2VLVideoProcessor
except ImportError:
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
D = sys.argv[1] if len(sys.argv) > 1 else "/tmp/omni-cand/tiny-omni"
tok = AutoTokenizer.from_pretrained(D)
fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300, n_fft=400,
                             padding_value=0.0, return_attention_mask=True)
img = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=12845056,
                            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
vid = Qwen2VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
proc = Qwen3OmniMoeProcessor(image_processor=img, video_processor=vid, feature_extractor=fe, tokenizer=tok,
                             chat_template=tok.chat_template)
proc.save_pretrained(D)
print(sorted(os.listdir(D)))
