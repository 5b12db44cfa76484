"""Prompt shards written by hand, member by member, as a broken or hostile copy would hold them (the writer,
data.write_prompt_shards, refuses to write such records)."""

import io
import tarfile


def hand_tar(path, samples):
    """A tar at `path` of samples = [(key, {ext: bytes})], each member `key.ext`; returns the path as a str."""
    with tarfile.open(path, "w") as tf:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return str(path)
