"""age (filippo.io/age) encryption of exported weights: the recipients a Tinker client names in
`save_weights_external`, checked by the API and used by the trainer."""

from __future__ import annotations

from pathlib import Path

import pyrage

AGE_SUFFIX = ".age"  # an encrypted file's name: the plain file's name + this


def age_recipient(text: str) -> pyrage.x25519.Recipient | pyrage.ssh.Recipient:
    """A recipient from its text: a native `age1...` key or an SSH public key (ssh-ed25519, ssh-rsa); ValueError
    saying what it is not."""
    kind = pyrage.x25519.Recipient if text.startswith("age1") else pyrage.ssh.Recipient
    try:
        return kind.from_str(text.strip())
    except Exception as e:  # pyrage's RecipientError
        raise ValueError(f"{text[:48]!r} is not an age recipient (a native age1... key or an ssh-ed25519/ssh-rsa "
                         f"public key): {e}") from None


def encrypt_files(folder: Path, recipients: list[str]) -> None:
    """Replace each file of `folder` by `<file>.age`, encrypted to every one of `recipients`: any one of their
    identities decrypts it (`age -d -i <identity>`)."""
    keys = [age_recipient(r) for r in recipients]
    for path in [p for p in folder.iterdir() if p.is_file()]:
        path.with_name(path.name + AGE_SUFFIX).write_bytes(pyrage.encrypt(path.read_bytes(), keys))
        path.unlink()
