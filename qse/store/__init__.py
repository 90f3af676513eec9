"""The shadow reader's memory and disk: resident states under QSE_SHADOW_GB, the rest parked on disk.

`ShadowStore` is the reader's residency manager (qse.shadow.reader.Residency); `disk` is the file
format of a parked session; `policy` holds the pure decisions (who leaves, which files go).
"""

from .disk import FileMiss, Fingerprint
from .store import GIB, ShadowStore

__all__ = ["GIB", "FileMiss", "Fingerprint", "ShadowStore"]
