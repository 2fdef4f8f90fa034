"""Fusion algorithms over arrays: BBP-MAP matching (PFNM, NAFI), layer-wise matching, KL-fusion."""
