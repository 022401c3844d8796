"""The protobuf messages of the Tinker wire (package `tinker_public`) that this server reads and writes: the
`forward_backward` request and its output. The schema is declared here, field numbers as the SDK (0.38.0) sends
them; the server never imports the SDK. Fields it does not read (image chunks' contents) are left out: protobuf
skips unknown fields."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from shared.contracts.messages import TinkerDatum
from shared.contracts.tinker_run import LOSS_OPTIONAL_INPUTS

F = descriptor_pb2.FieldDescriptorProto
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3


def _message(name: str, *fields: tuple, maps: tuple = (), oneofs: tuple = ()) -> descriptor_pb2.DescriptorProto:
    """fields: (name, number, type, type_name or None, repeated, oneof index or None)."""
    msg = descriptor_pb2.DescriptorProto(name=name)
    for one in oneofs:
        msg.oneof_decl.add(name=one)
    for fname, number, ftype, type_name, repeated, oneof in fields:
        f = msg.field.add(name=fname, number=number, type=ftype,
                          label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
        if type_name:
            f.type_name = type_name
        if oneof is not None:
            f.oneof_index = oneof
    for fname, number, entry, value_type, value_type_name in maps:  # map<string, value>
        nested = msg.nested_type.add(name=entry)
        nested.options.map_entry = True
        nested.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        value = nested.field.add(name="value", number=2, type=value_type, label=F.LABEL_OPTIONAL)
        if value_type_name:
            value.type_name = value_type_name
        msg.field.add(name=fname, number=number, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                      type_name=f".tinker_public.{name}.{entry}")
    return msg


def _schema() -> dict[str, type]:
    file = descriptor_pb2.FileDescriptorProto(name="flywheel_tinker_public.proto", package="tinker_public",
                                              syntax="proto3")
    M, B, S, I32, U32, I64, D, E, BOOL = (F.TYPE_MESSAGE, F.TYPE_BYTES, F.TYPE_STRING, F.TYPE_INT32, F.TYPE_UINT32,
                                          F.TYPE_INT64, F.TYPE_DOUBLE, F.TYPE_ENUM, F.TYPE_BOOL)
    dtype = file.enum_type.add(name="DType")
    for i, n in enumerate(("DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16")):
        dtype.value.add(name=n, number=i)
    stop_reason = file.enum_type.add(name="StopReason")
    for i, n in enumerate(("STOP_REASON_STOP", "STOP_REASON_LENGTH")):
        stop_reason.value.add(name=n, number=i)
    file.message_type.extend([
        _message("SparseCsr", ("values", 1, B, None, False, None), ("crow_indices", 2, B, None, False, None),
                 ("col_indices", 3, B, None, False, None)),
        _message("Tensor", ("dense", 1, B, None, False, 0), ("sparse_csr", 2, M, ".tinker_public.SparseCsr", False, 0),
                 ("dtype", 3, E, ".tinker_public.DType", False, None), ("shape", 4, I64, None, True, None),
                 oneofs=("encoding",)),
        _message("EncodedTextChunk", ("tokens", 1, B, None, False, None)),
        _message("OtherChunk"),  # an image or audio chunk: not served, only recognised
        _message("Chunk", ("encoded_text", 1, M, ".tinker_public.EncodedTextChunk", False, 0),
                 ("image", 2, M, ".tinker_public.OtherChunk", False, 0),
                 ("dmel", 3, M, ".tinker_public.OtherChunk", False, 0), oneofs=("chunk",)),
        _message("PromptProvenanceSpan", ("sequence_id", 1, S, None, False, None), ("offset", 2, I64, None, False, None),
                 ("length", 3, I64, None, False, None)),
        _message("SampledProvenanceSpan", ("sequence_id", 1, S, None, False, None),
                 ("offset", 2, I64, None, False, None), ("length", 3, I64, None, False, None)),
        _message("ProvenanceSpan", ("prompt_tokens", 1, M, ".tinker_public.PromptProvenanceSpan", False, 0),
                 ("sampled_tokens", 2, M, ".tinker_public.SampledProvenanceSpan", False, 0), oneofs=("span",)),
        _message("Datum", ("model_input", 1, M, ".tinker_public.Chunk", True, None),
                 ("model_input_spans", 3, M, ".tinker_public.ProvenanceSpan", True, None),
                 ("loss_fn_input_spans", 4, M, ".tinker_public.ProvenanceSpan", True, None),
                 maps=(("loss_fn_inputs", 2, "LossFnInputsEntry", M, ".tinker_public.Tensor"),)),
        _message("LossConfigValue", ("number", 1, D, None, False, 0), ("text", 2, S, None, False, 0),
                 oneofs=("value",)),
        _message("ForwardBackwardRequest", ("model_id", 1, S, None, False, None), ("seq_id", 2, I32, None, False, None),
                 ("data", 3, M, ".tinker_public.Datum", True, None), ("loss_fn", 4, S, None, False, None),
                 ("forward_only", 6, BOOL, None, False, None),
                 maps=(("loss_fn_config", 5, "LossFnConfigEntry", D, None),
                       ("loss_fn_config_v2", 7, "LossFnConfigV2Entry", M, ".tinker_public.LossConfigValue"))),
        _message("BatchedTensor", ("data", 1, B, None, False, None), ("offsets", 2, B, None, False, None),
                 ("dtype", 3, E, ".tinker_public.DType", False, None), ("trailing_shape", 4, I64, None, True, None)),
        _message("ArrayRecord", ("type_tag", 1, S, None, False, None), ("num_datums", 3, I64, None, False, None),
                 maps=(("fields", 2, "FieldsEntry", M, ".tinker_public.BatchedTensor"),)),
        _message("TopkLogprobs", ("token_ids", 1, B, None, False, None), ("logprobs", 2, B, None, False, None),
                 ("k", 3, U32, None, False, None), ("length", 4, U32, None, False, None)),
        _message("SampledSequence", ("stop_reason", 1, E, ".tinker_public.StopReason", False, None),
                 ("tokens", 2, B, None, False, None), ("logprobs", 3, B, None, False, None),
                 ("topk_sampled_logprobs", 4, M, ".tinker_public.TopkLogprobs", False, None)),
        _message("PromptAltTokens", ("tokens", 1, M, ".tinker_public.Tensor", False, None),
                 ("logprobs", 2, M, ".tinker_public.Tensor", False, None)),
        _message("SampleResponse", ("sequences", 1, M, ".tinker_public.SampledSequence", True, None),
                 ("prompt_logprobs", 2, B, None, False, None),
                 ("topk_prompt_logprobs", 3, M, ".tinker_public.TopkLogprobs", False, None),
                 ("prompt_cache_hit_tokens", 4, I32, None, False, None),
                 ("target_prompt_logprobs", 5, M, ".tinker_public.Tensor", False, None),
                 ("prompt_alt_tokens", 6, M, ".tinker_public.PromptAltTokens", False, None)),
        _message("ForwardBackwardOutput", ("loss_fn_output_type", 1, S, None, False, None),
                 ("loss_fn_outputs", 2, M, ".tinker_public.ArrayRecord", True, None),
                 maps=(("metrics", 3, "MetricsEntry", D, None),)),
    ])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tinker_public.{m.name}"))
            for m in file.message_type}


_CLASSES = _schema()
ForwardBackwardRequest = _CLASSES["ForwardBackwardRequest"]
ForwardBackwardOutput = _CLASSES["ForwardBackwardOutput"]
SampleResponse = _CLASSES["SampleResponse"]
TopkLogprobs = _CLASSES["TopkLogprobs"]
Tensor = _CLASSES["Tensor"]
SparseCsr = _CLASSES["SparseCsr"]
STOP_REASONS = {"stop": 0, "length": 1}


class WireError(ValueError):
    """A request that cannot be served as sent: `field` is its path in the SDK's request."""

    def __init__(self, field: str, message: str, hint: str | None = None):
        super().__init__(message)
        self.field, self.message, self.hint = field, message, hint


_NUMPY = {DTYPE_FLOAT32: np.dtype("<f4"), DTYPE_INT64: np.dtype("<i8"), DTYPE_INT32: np.dtype("<i4")}


def tensor_values(tensor, field: str) -> np.ndarray:
    """A dense Tensor's values, flat."""
    if tensor.WhichOneof("encoding") != "dense":
        raise WireError(field, "sparse tensors are not supported by this server", hint="send dense TensorData")
    if tensor.dtype not in _NUMPY:
        raise WireError(field, f"tensor dtype {tensor.dtype} is not supported; send float32 or int64")
    return np.frombuffer(tensor.dense, dtype=_NUMPY[tensor.dtype])


def decode_datums(request, loss_inputs: dict[str, tuple[str, ...]]) -> list[TinkerDatum]:
    """The request's datums, checked: text chunks only; `target_tokens` and the loss's inputs present, each one
    value per input token; `target_tokens` the input shifted by one (the next token at each position)."""
    needs = loss_inputs[request.loss_fn]
    known = {"target_tokens", "weights", *needs, *LOSS_OPTIONAL_INPUTS.get(request.loss_fn, ())}
    out = []
    for i, datum in enumerate(request.data):
        where = f"forward_backward_input.data[{i}]"
        tokens = []
        for j, chunk in enumerate(datum.model_input):
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"{where}.model_input.chunks[{j}]", "only text chunks (EncodedTextChunk) are served")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
        if not tokens:
            raise WireError(f"{where}.model_input", "the model input is empty")
        inputs = {}
        for name in sorted(datum.loss_fn_inputs):
            field = f"{where}.loss_fn_inputs.{name}"
            if name not in known:
                raise WireError(field, f"{name!r} is not an input of loss {request.loss_fn!r}",
                                hint=f"its inputs: {', '.join(sorted(known))}")
            values = tensor_values(datum.loss_fn_inputs[name], field)
            if len(values) != len(tokens):
                raise WireError(field, f"has {len(values)} values but model_input has {len(tokens)} tokens",
                                hint="every loss input has one value per input token")
            inputs[name] = values
        for name in ("target_tokens", *needs):
            if name not in inputs:
                raise WireError(f"{where}.loss_fn_inputs.{name}", f"loss {request.loss_fn!r} needs {name!r}")
        targets = inputs.pop("target_tokens").astype(np.int64).tolist()
        if targets[:-1] != tokens[1:]:
            raise WireError(f"{where}.loss_fn_inputs.target_tokens",
                            "target_tokens must be model_input shifted by one (the next token at each position)",
                            hint="this server trains on next-token targets: tokens[1:] of the sequence the input "
                                 "is tokens[:-1] of (tinker_cookbook's datum helpers build them so)")
        out.append(TinkerDatum(tokens=tokens, target_tokens=targets,
                               **{k: v.astype(np.float32).tolist() for k, v in inputs.items()}))
    return out


@dataclass(frozen=True)
class SampledSpan:
    """Datum positions [start, start + length) reproduce sampled tokens [offset, offset + length) of a sample."""
    sequence_id: str
    start: int
    offset: int
    length: int


def sampled_spans(request, data: list[TinkerDatum]) -> list[list[SampledSpan]]:
    """Per datum (`data`: the request's, decoded), the runs of its targets that its provenance
    (`loss_fn_input_spans`, which tile the targets) says were sampled; WireError when a datum has none or its runs
    do not tile its targets."""
    out = []
    for i, (datum, decoded) in enumerate(zip(request.data, data, strict=True)):
        field = f"forward_backward_input.data[{i}].loss_fn_input_spans"
        start, spans = 0, []
        for span in datum.loss_fn_input_spans:
            kind = span.WhichOneof("span")
            run = getattr(span, kind) if kind else None
            if run is None or not run.sequence_id or run.offset < 0 or run.length < 0:
                raise WireError(field, "a provenance span without a sequence id, or with a negative offset or length")
            if kind == "sampled_tokens" and run.length:
                spans.append(SampledSpan(run.sequence_id, start, run.offset, run.length))
            start += run.length
        targets = len(decoded.target_tokens)
        if not spans or start != targets:
            raise WireError(field, f"loss {request.loss_fn!r} needs provenance on every datum: spans that tile its "
                            f"{targets} targets, some of them sampled (these cover {start}, "
                            f"{len(spans)} sampled)", hint="build datums from samples that carry their sequence_id, "
                            "with Datum.with_provenance (tinker_cookbook does for its RL datums)")
        out.append(spans)
    return out


def encode_output(result: dict) -> bytes:
    """A forward_backward result (`loss_fn_outputs`: per datum, name -> float list; `metrics`) as the SDK's
    protobuf ForwardBackwardOutput: one ArrayRecord, each field a BatchedTensor of every datum's values."""
    out = ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics.update(result.get("metrics", {}))
    datums = result["loss_fn_outputs"]
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(datums))
    for name in (datums[0] if datums else {}):
        arrays = [np.asarray(d[name], dtype="<f4") for d in datums]
        field = record.fields[name]
        field.dtype = DTYPE_FLOAT32
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype="<i8").astype("<i8").tobytes()
    return out.SerializeToString()


def encode_samples(result: dict) -> bytes:
    """A sample result (`sequences`: tokens, logprobs, stop_reason, `topk` when asked; `prompt_logprobs`,
    `topk_prompt_logprobs`, `target_prompt_logprobs` and `prompt_alt_tokens` when asked) as the SDK's protobuf
    SampleResponse; an unscored prompt position is NaN."""
    out = SampleResponse()
    for seq in result["sequences"]:
        added = out.sequences.add(stop_reason=STOP_REASONS[seq["stop_reason"]],
                                  tokens=np.asarray(seq["tokens"], dtype="<i4").tobytes(),
                                  logprobs=np.asarray(seq["logprobs"], dtype="<f4").tobytes())
        if "topk" in seq:
            added.topk_sampled_logprobs.CopyFrom(encode_topk(seq["topk"]))
    if "prompt_logprobs" in result:
        values = [np.nan if v is None else v for v in result["prompt_logprobs"]]
        out.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if "topk_prompt_logprobs" in result:
        out.topk_prompt_logprobs.CopyFrom(encode_topk(result["topk_prompt_logprobs"]))
    out.prompt_cache_hit_tokens = result.get("prompt_cache_hit_tokens", 0)
    if "target_prompt_logprobs" in result:
        out.target_prompt_logprobs.CopyFrom(encode_targets(result["target_prompt_logprobs"],
                                                           result.get("target_sparse", False)))
    if "prompt_alt_tokens" in result:
        rows = result["prompt_alt_tokens"]
        k = len(rows[0]) if rows else 0
        out.prompt_alt_tokens.tokens.CopyFrom(dense_tensor([[t for t, _ in r] for r in rows], DTYPE_INT64, k))
        out.prompt_alt_tokens.logprobs.CopyFrom(dense_tensor([[v for _, v in r] for r in rows], DTYPE_FLOAT32, k))
    return out.SerializeToString()


def dense_tensor(rows: list[list], dtype: int, width: int):
    """Rows of `width` numbers as a dense Tensor of shape [len(rows), width]."""
    values = np.asarray(rows, dtype=_NUMPY[dtype]).reshape(len(rows), width)
    return Tensor(dense=values.tobytes(), dtype=dtype, shape=list(values.shape))


def encode_targets(rows: list[list[float | None]], sparse: bool):
    """Target prompt logprobs (rows of K; a cell not asked for is 0.0, or None when the request's tensor was
    sparse) as a float32 Tensor in the request's layout: dense, or sparse CSR listing the cells asked for."""
    width = len(rows[0]) if rows else 0
    if not sparse:
        return dense_tensor(rows, DTYPE_FLOAT32, width)
    listed = [[(j, v) for j, v in enumerate(r) if v is not None] for r in rows]
    crow = np.cumsum([0] + [len(r) for r in listed], dtype="<i8")
    csr = SparseCsr(values=np.asarray([v for r in listed for _, v in r], dtype="<f4").tobytes(),
                    crow_indices=crow.tobytes(),
                    col_indices=np.asarray([j for r in listed for j, _ in r], dtype="<i8").tobytes())
    return Tensor(sparse_csr=csr, dtype=DTYPE_FLOAT32, shape=[len(rows), width])


TOPK_EMPTY = (0, -99999.0)  # the SDK's filler of a position with fewer than k (or no) tokens


def encode_topk(rows: list[list | None]):
    """Per position, up to k (token id, logprob) pairs or None, as the SDK's TopkLogprobs: two dense (length, k)
    matrices, short rows and None filled with TOPK_EMPTY."""
    k = max((len(r) for r in rows if r), default=0)
    filled = [list(map(tuple, r or ())) + [TOPK_EMPTY] * (k - len(r or ())) for r in rows]
    ids = np.asarray([[t for t, _ in row] for row in filled], dtype="<i4").reshape(len(rows), k)
    values = np.asarray([[v for _, v in row] for row in filled], dtype="<f4").reshape(len(rows), k)
    return TopkLogprobs(token_ids=ids.tobytes(), logprobs=values.tobytes(), k=k, length=len(rows))
