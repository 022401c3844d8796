"""age encryption of exported weights: each file replaced by `<file>.age`, which any one recipient's identity
decrypts to the original bytes; a recipient that is not one is named in the error."""

from __future__ import annotations

import pyrage
import pytest

from shared.weights.age import age_recipient, encrypt_files


def test_each_file_is_replaced_by_its_encryption_to_every_recipient(tmp_path):
    alice, bob = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    plain = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 40}
    for name, data in plain.items():
        (tmp_path / name).write_bytes(data)
    encrypt_files(tmp_path, [str(alice.to_public()), str(bob.to_public())])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n + ".age" for n in plain)
    for name, data in plain.items():
        sealed = (tmp_path / (name + ".age")).read_bytes()
        assert data not in sealed
        assert pyrage.decrypt(sealed, [alice]) == data == pyrage.decrypt(sealed, [bob])
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt(sealed, [pyrage.x25519.Identity.generate()])


def test_ssh_keys_are_recipients_and_anything_else_is_named():
    ed25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHsKLqeplhpW+uObz5dvMgjz1OxfM/XXUB+VHtZ6isGN alice@example"
    assert age_recipient(ed25519) is not None
    for bad in ("age1notakey", "ssh-ed25519 AAAA", "hello"):
        with pytest.raises(ValueError, match="is not an age recipient"):
            age_recipient(bad)
