"""Voices as a server resource:

  GET    /v1/audio/voices         every voice: {"voices": [names], "data": [{name, seconds, transcript, stored}]}
  POST   /v1/audio/voices         multipart: `name`, `audio` (the recording), optional `transcript`, `replace`
                                  (true to replace a voice of that name; else 409): checked like --ref-audio, encoded
                                  once, stored under --voices DIR (voices.py) → 201 and the voice; in a cluster the
                                  store is the ingress's and every request carries its voice's codes to a replica
  GET    /v1/audio/voices/{name}  one voice; 404 if none
  DELETE /v1/audio/voices/{name}  removes it and its files

A failed upload stores nothing: the checks and the encoding come first, the file is written last, atomically.
"""

import asyncio
from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from higgs_trt.runtime.audio import reference_audio_from_bytes

from .speech_api import ApiError, field
from .voices import VoiceExists, VoiceMissing, check_fits, check_name

UPLOAD_FIELDS = {"name", "audio", "transcript", "replace"}


def voice_routes(service) -> list[Route]:
    return [Route("/v1/audio/voices", partial(listing, service), methods=["GET"]),
            Route("/v1/audio/voices", partial(upload, service), methods=["POST"]),
            Route("/v1/audio/voices/{name}", partial(one, service), methods=["GET", "DELETE"])]


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


async def listing(service, request: Request) -> Response:
    voices = service.voices
    return JSONResponse({"voices": list(voices), "data": [voice.describe(name) for name, voice in voices.items()]})


async def one(service, request: Request) -> Response:
    name = request.path_params["name"]
    try:
        if request.method == "DELETE":
            await run_in_threadpool(service.store.delete, name)
            return JSONResponse({"deleted": name})
        if name not in service.voices:
            raise VoiceMissing(f"no voice {name[:80]!r}")
        return JSONResponse(service.voices[name].describe(name))
    except VoiceMissing as e:
        return _error(ApiError(404, str(e), "name", "voice_not_found"))


async def upload(service, request: Request) -> Response:
    try:
        if not service.engine.ready.is_set():  # the encoder and the engine's limits are needed
            raise ApiError(503, "the engine is loading" if not service.engine.failure else
                           f"the engine failed: {service.engine.failure}", None, "not_ready", "server_error",
                           {"Retry-After": "5"})
        name, audio, transcript, replace = await _form(service, request)
        if name in service.voices and not replace:
            raise ApiError(409, f"voice {name!r} exists; send replace=true to replace it", "name", "voice_exists")
        with field("audio"):
            reference = await run_in_threadpool(reference_audio_from_bytes, audio, "audio")
        if service.engine.no_encoder is not None:
            raise ApiError(400, f"audio cannot be encoded here: {service.engine.no_encoder}", "audio",
                           "unsupported_parameter")
        with field("audio"):  # a voice no request could use is refused now, not at each request
            codes = await service.engine.encode(reference)
            check_fits(service.engine.spec, service.tokenizer, codes, transcript)
        with field("name"):
            voice = await run_in_threadpool(service.store.add, name, codes, transcript, replace)
    except VoiceExists as e:
        return _error(ApiError(409, str(e), "name", "voice_exists"))
    except ApiError as e:
        return _error(e)
    return JSONResponse(voice.describe(name), 201)


async def _form(service, request: Request) -> tuple[str, bytes, str | None, bool]:
    """The upload's fields, checked; the body is read under the server's size cap and deadline."""
    if service.store.directory is None:
        raise ApiError(400, "this server stores no voices: it was started without --voices DIR", None,
                       "no_voice_store")
    multipart = "the body must be multipart/form-data with fields name, audio, transcript"
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, f"{multipart} (content type: {request.headers.get('content-type', 'none')})", None,
                       "invalid_multipart")
    body, large = await service._body(request, asyncio.get_running_loop().time() + service.timeout)
    service.large_bodies -= large  # a place held only while the body is read

    async def chunks():
        yield body

    try:
        form = await MultiPartParser(request.headers, chunks(), max_files=1, max_fields=len(UPLOAD_FIELDS)).parse()
    except MultiPartException as e:
        raise ApiError(400, f"{multipart} ({e})", None, "invalid_multipart") from None
    unknown = sorted(set(form.keys()) - UPLOAD_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r} (an upload takes {', '.join(sorted(UPLOAD_FIELDS))})",
                       unknown[0], "unknown_parameter")
    name, audio, transcript, replace = (form.get(k) for k in ("name", "audio", "transcript", "replace"))
    if not isinstance(name, str):
        raise ApiError(400, "name is required: the voice's name (a form field)", "name", "missing_required_parameter")
    with field("name"):
        check_name(name, "name")
    if not isinstance(audio, UploadFile):
        raise ApiError(400, "audio is required: the recording, as a file part", "audio", "missing_required_parameter")
    data = await audio.read()
    if transcript is not None:
        if not isinstance(transcript, str):
            raise ApiError(400, "transcript must be a text field, not a file", "transcript", "invalid_type")
        transcript = transcript.strip() or None
        if transcript is not None:
            with field("transcript"):
                service.store.check_transcript(transcript, "transcript")
    if replace not in (None, "true", "false"):
        raise ApiError(400, "replace must be true or false", "replace")
    return name, data, transcript, replace == "true"

