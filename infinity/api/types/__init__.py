"""The HTTP API's request and response bodies as msgspec types, one module per route
family (as `infinity.api.routes`): requests are decoded and checked with them, answers
encoded from them, and the OpenAPI document is built from them."""
