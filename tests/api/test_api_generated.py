"""The committed Python code for the protos matches what protoc makes of them today."""

from pathlib import Path

from meridian.api import generate


def test_generated_code_is_up_to_date(tmp_path: Path):
    fresh = generate.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = generate.PACKAGE_DIR / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -P -m meridian.api.generate`"
        )


def test_service_is_versioned_and_complete():
    from meridian.api.v1 import pb

    service = pb.DESCRIPTOR.services_by_name["Inference"]
    assert service.full_name == "meridian.v1.Inference"
    assert {m.name for m in service.methods} == {"Generate", "Models", "LoadReport", "Tokenizer"}
    assert service.methods_by_name["Generate"].server_streaming
    assert service.methods_by_name["LoadReport"].server_streaming
