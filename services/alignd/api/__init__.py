"""The REST control API: publish and sync weight versions, rollouts and scores, guidance, status.

``create_app`` (:mod:`alignd.api.app`) builds the FastAPI application; ``python -m
alignd.api.main`` serves it with uvicorn. Wire models live in ``alignclient.models`` so
the Python client and the server validate the same shapes.
"""
