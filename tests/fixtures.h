/* tests/fixtures.h -- inputs shared by tests/unit.c and tests/fuzz.c (each
 * includes it after ../ltg.c). */

/* A catalog for catalog_load: the models A to E and "x/y~z" (a name a JSON
 * pointer must escape), all on the provider p. */
static const char FIXTURE_CATALOG[] =
    "{\"providers\":{\"p\":{\"base_url\":\"http://x\"}},\"models\":{"
    "\"A\":{\"provider\":\"p\",\"upstream_model\":\"a\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
    "\"B\":{\"provider\":\"p\",\"upstream_model\":\"b\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
    "\"C\":{\"provider\":\"p\",\"upstream_model\":\"c\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
    "\"D\":{\"provider\":\"p\",\"upstream_model\":\"d\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
    "\"E\":{\"provider\":\"p\",\"upstream_model\":\"e\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1},"
    "\"x/y~z\":{\"provider\":\"p\",\"upstream_model\":\"xyz\",\"input_usd_per_mtok\":1,\"output_usd_per_mtok\":1}}}";

/* A token group on FIXTURE_CATALOG that sets every field: A falls back to B,
 * C and D; 5 linear attempts; a 7-day budget of 0.123456; cache_ttl 0; one
 * request at a time; blocked. */
static const char FIXTURE_FULL_GROUP[] =
    "{\"name\":\"g\",\"allowed_models\":[\"A\",\"B\",\"C\",\"D\",\"E\"],\"fallbacks\":{\"A\":[\"B\",\"C\",\"D\"]},"
    "\"retries\":{\"max_attempts\":5,\"retry_delay_ms\":60000,\"backoff\":\"linear\",\"request_timeout_ms\":100},"
    "\"max_budget\":0.123456,\"budget_duration\":\"7d\",\"cache_ttl\":0,\"max_parallel_requests\":1,\"blocked\":true}";
