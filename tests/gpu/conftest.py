from tests.service.conftest import tiny_model  # noqa: F401 - the session's tiny trained model
