"""The encoder benchmark's onnxruntime baseline computes the model it stands for."""

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("transformers")

from benchmarks import bench_encoder_vs as bev  # noqa: E402


def test_the_onnx_export_is_bert_and_the_check_tells_models_apart(tmp_path):
    """The exported graph gives BertModel's hidden states on a padded batch of another shape than
    the one it was traced with; the same check against a different copy's weights fails, so a
    wrong export could not pass it."""
    first, second = bev.bert_copy(0), bev.bert_copy(1)
    session = bev.export_onnx(first, str(tmp_path / "m.onnx"))
    assert bev.onnx_matches(first, session, seed=3) < 1e-3
    assert bev.onnx_matches(second, session, seed=3) > 1e-3
