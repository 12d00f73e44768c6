"""The Tinker wire formats against the SDK's own converters: what its forward_backward sends decodes to the same
tokens and inputs, what the server answers deserializes (in the SDK) to the same arrays."""

import numpy as np
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from reinforge.tinker.wire import (
    WireSequence,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)


def test_a_forward_backward_request_decodes_to_its_tokens_and_inputs():
    datum = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[7])]
        ),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array([6, 7, 8], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.array([0.0, 1.0, 0.5], dtype=np.float32)),
        },
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7, "mode": "x"}
        ),
        model_id="s:train:0",
        seq_id=4,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    call = decode_forward_backward(message.SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 4, "ppo", True)
    assert call.loss_fn_config == {"clip_low_threshold": 0.7, "mode": "x"}
    (decoded,) = call.data
    assert decoded.tokens == [5, 6, 7] and decoded.sampled is None
    assert decoded.inputs["target_tokens"].tolist() == [6, 7, 8]
    assert decoded.inputs["weights"].tolist() == [0.0, 1.0, 0.5]


def test_outputs_deserialize_in_the_sdk_as_sent():
    outputs = [{"logprobs": np.array([-1.0, -2.0])}, {"logprobs": np.array([-0.5])}]
    result = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {"loss:sum": 3.5}))
    assert result.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].to_numpy().tolist() for o in result.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    sample = deserialize_sample_response(
        encode_sample_response(
            [WireSequence([3, 4], [-0.25, -0.5], "stop"), WireSequence([9], [-1.0], "length")], [None, -2.0]
        )
    )
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([3, 4], [-0.25, -0.5], "stop"),
        ([9], [-1.0], "length"),
    ]
    assert sample.prompt_logprobs == [None, -2.0]
