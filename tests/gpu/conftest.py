from tests.service.conftest import library, mnist, pngs, tiny_model  # noqa: F401 - shared fixtures
