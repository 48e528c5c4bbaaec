"""pagewire's gateway: public API, continuous-batching scheduler, streaming, CLI and launcher."""
