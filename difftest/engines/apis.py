"""How a segment is asked of a vLLM-Omni server, by its model family: the request, the answer's WAV.

One entry per family (difftest/family.py); the HTTP candidate (engines/http.py) looks the segment's
family up here instead of branching on it."""

from __future__ import annotations

from ..family import FAMILY_OF_TASK, QWEN3_OMNI, QWEN3_TTS
from . import omni_chat
from .speech_client import SpeechAnswer, SpeechClient, SpeechError, speech_request


class SpeechApi:
    """Qwen3-TTS: POST /v1/audio/speech; the answer's body is the WAV."""

    path, answer = "/v1/audio/speech", "wav"  # what a repro bundle's script sends, and how it reads the answer

    def repro_body(self, seg) -> dict:
        """The request a repro bundle sends for `seg` (its voice inline), without difftest's capture tag."""
        body = speech_request(seg, f"repro-{seg.id}", voice_mode="inline")
        body["extra_params"].pop("difftest_tag", None)
        return body

    @staticmethod
    def row(body: dict) -> dict:
        """What a repro's ISSUE.md shows of a request: task, language, voice, text, length."""
        return {"task": body.get("task_type"), "language": body.get("language"), "voice": body.get("voice"),
                "text": body.get("input"), "max_new_tokens": body.get("max_new_tokens")}

    def ask(self, client: SpeechClient, seg, tag: str, voice_mode: str, hint: dict | None) -> tuple[SpeechAnswer, bytes]:
        ans = client.speech(speech_request(seg, tag, voice_mode=voice_mode), hint)
        return ans, ans.audio


class ChatApi:
    """Qwen3-Omni: POST /v1/chat/completions with audio output; the WAV is base64 in the answer's JSON."""

    path, answer = "/v1/chat/completions", "chat"

    def repro_body(self, seg) -> dict:
        return omni_chat.chat_body(seg)  # no tag: nothing of difftest's reaches the server

    @staticmethod
    def row(body: dict) -> dict:
        talker = body["sampling_params_list"][1]
        return {"task": "chat", "language": None, "voice": body.get("speaker"),
                "text": body["messages"][0]["content"], "max_new_tokens": talker.get("max_tokens")}

    def ask(self, client: SpeechClient, seg, tag: str, voice_mode: str, hint: dict | None) -> tuple[SpeechAnswer, bytes]:
        body = omni_chat.chat_body(seg, tag)
        ans = client.chat(body, omni_chat.answer_bound(body))
        try:
            return ans, omni_chat.answer_wav(ans.audio)
        except ValueError as e:
            raise SpeechError(200, str(e)) from None


API_OF_FAMILY = {QWEN3_TTS.name: SpeechApi(), QWEN3_OMNI.name: ChatApi()}
API_OF_PATH = {api.path: api for api in API_OF_FAMILY.values()}  # a repro bundle's request names its path


def api_for(seg):
    return API_OF_FAMILY[FAMILY_OF_TASK[seg.task].name]
