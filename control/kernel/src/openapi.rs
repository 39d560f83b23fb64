//! The OpenAPI 3.1 document of a control plane, generated from what its modules registered: every method as
//! `POST /api/compute/{group}/{method}` with its request and response schemas (JSON Schema 2020-12 from the Rust
//! types and their serde attributes, through schemars, so the document cannot drift from the code), the
//! permission and scope it needs (`x-permission`, `x-scope`, `x-scope-check`), the `{code, message}` error body
//! and its codes; the modules' own routes; the kernel's `/healthz`, `/readyz` and `/api/openapi.json`; and the
//! paths the binary serves itself ([`ControlPlaneBuilder::api_path`](crate::ControlPlaneBuilder::api_path)).
//! Served at `GET /api/openapi.json`.

use crate::method::{MethodDef, Permission, ScopeKind};
use crate::module::Module;
use crate::plane::Kind;
use bc_core::api::ApiCode;
use schemars::generate::SchemaSettings;
use serde_json::{Map, Value, json};

/// Where the document is served (no key needed: it is the same for every caller, and the repository's
/// docs/openapi.json).
pub const OPENAPI_PATH: &str = "/api/openapi.json";

/// The HTTP statuses a method may answer besides 200, each with the codes it carries.
const ERROR_STATUSES: &[(&str, &str, &[ApiCode])] = &[
    (
        "400",
        "The request is malformed: a field is missing, unknown or out of range (the message names it), or the body is not JSON.",
        &[ApiCode::InvalidArgument],
    ),
    (
        "401",
        "No API key, or one the control plane does not know (`Authorization: Bearer <api key>`).",
        &[ApiCode::Unauthenticated],
    ),
    (
        "403",
        "The caller lacks the method's permission on its scope (the message names the grant to ask for).",
        &[ApiCode::AccessDenied],
    ),
    (
        "404",
        "The method, or the resource the request names, does not exist.",
        &[ApiCode::NotFound],
    ),
    (
        "409",
        "The request conflicts with the resource's state (an idempotency key reused with another body, a verb the state does not allow).",
        &[ApiCode::Conflict, ApiCode::FailedPrecondition],
    ),
    (
        "413",
        "The body is larger than 2 MiB.",
        &[ApiCode::InvalidArgument],
    ),
    (
        "415",
        "The body is not `Content-Type: application/json`.",
        &[ApiCode::InvalidArgument],
    ),
    (
        "503",
        "The control plane cannot answer now (its database is unreachable); retry with backoff.",
        &[ApiCode::Unavailable],
    ),
];

/// The document of `modules` (in start order) plus `extra` paths the binary serves.
pub(crate) fn document(modules: &[(Kind, Module)], extra: &[(&'static str, Value)]) -> Value {
    let mut settings = SchemaSettings::draft2020_12();
    settings.definitions_path = "/components/schemas".into();
    let mut generator = settings.into_generator();
    let mut paths = Map::new();
    let mut methods: Vec<(&'static str, &MethodDef)> = modules
        .iter()
        .flat_map(|(_, m)| m.methods.iter().map(move |d| (m.name, d)))
        .collect();
    methods.sort_by_key(|(_, d)| (d.group, d.method));
    for (module, def) in methods {
        let (request, response) = (def.schemas)(&mut generator);
        paths.insert(
            format!("/api/compute/{}/{}", def.group, def.method),
            json!({ "post": method_operation(module, def, request.to_value(), response.to_value()) }),
        );
    }
    let mut routes: Vec<(&'static str, &crate::module::Route)> = modules
        .iter()
        .flat_map(|(_, m)| m.routes.iter().map(move |r| (m.name, r)))
        .collect();
    routes.sort_by_key(|(_, r)| r.path);
    for (module, route) in routes {
        let answer = route.answer.map(|f| f(&mut generator).to_value());
        paths.insert(route.path.to_string(), route_item(module, route, answer));
    }
    for (path, item) in kernel_paths().into_iter().chain(extra.iter().cloned()) {
        paths.insert(path.to_string(), item);
    }
    let mut schemas = generator.take_definitions(true);
    schemas.insert("ApiError".into(), api_error_schema());
    let mut responses = Map::new();
    for (status, description, codes) in ERROR_STATUSES {
        responses.insert(format!("E{status}"), error_response(description, codes));
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Better Compute control plane API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Every method is `POST /api/compute/{group}/{method}` with a JSON body (an empty body \
                reads as `{}`) and `Authorization: Bearer <api key>`. The caller needs the permission in \
                `x-permission` on the scope in `x-scope`; `x-scope-check` says when it is checked: `fixed` and \
                `request` before the handler runs, `resource` once the handler read the resource (a node's \
                pool), `filtered` per item of a list, `handler` by the handler itself. Every error is \
                `{code, message}` with a stable code. Instants are integers in milliseconds since the epoch \
                where the schema says `format: unix-epoch-ms`.",
            "license": { "name": "Apache-2.0", "identifier": "Apache-2.0" },
        },
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "security": [{ "apiKey": [] }],
        "paths": Value::Object(sorted(paths)),
        "components": {
            "schemas": Value::Object(sorted(schemas)),
            "responses": Value::Object(responses),
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key (`bcak_…`): `better-compute bootstrap-admin` or `principals.create` \
                        makes one.",
                },
            },
        },
    })
}

fn sorted(map: Map<String, Value>) -> Map<String, Value> {
    let mut entries: Vec<(String, Value)> = map.into_iter().collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    entries.into_iter().collect()
}

fn method_operation(module: &str, def: &MethodDef, request: Value, response: Value) -> Value {
    let permission = def.permission.unwrap_or(Permission::AnyCaller);
    let scope = def.scope.map(|s| s.pattern);
    let check = def.scope.map(|s| match s.kind {
        ScopeKind::Fixed => "fixed",
        ScopeKind::Request => "request",
        ScopeKind::Resource => "resource",
        ScopeKind::Filtered => "filtered",
        ScopeKind::Handler => "handler",
    });
    let who = match (permission, scope) {
        (Permission::AnyCaller, _) => "Any authenticated caller may call it.".to_string(),
        (Permission::Grant(p), Some(s)) => format!(
            "Needs `{p}` on `{s}` ({}).",
            match check.unwrap_or_default() {
                "fixed" | "request" => "checked before the handler runs",
                "resource" => "checked once the resource is read",
                "filtered" => "a list shows only the items the grant covers",
                _ => "checked by the handler",
            }
        ),
        (Permission::Grant(p), None) => format!("Needs `{p}`."),
    };
    let mut responses = Map::new();
    responses.insert(
        "200".into(),
        json!({
            "description": "The answer.",
            "content": { "application/json": { "schema": response } },
        }),
    );
    for (status, _, _) in ERROR_STATUSES {
        if *status == "403" && permission == Permission::AnyCaller {
            continue;
        }
        responses.insert(
            (*status).into(),
            json!({ "$ref": format!("#/components/responses/E{status}") }),
        );
    }
    let mut op = json!({
        "operationId": format!("{}.{}", def.group, def.method),
        "tags": [def.group],
        "summary": format!("{}.{}", def.group, def.method),
        "description": who,
        "x-module": module,
        "x-permission": permission.name(),
        "requestBody": {
            "required": false,
            "description": "The request; an empty body reads as `{}`.",
            "content": { "application/json": { "schema": request } },
        },
        "responses": Value::Object(responses),
    });
    if let (Some(scope), Some(check), Value::Object(o)) = (scope, check, &mut op) {
        o.insert("x-scope".into(), json!(scope));
        o.insert("x-scope-check".into(), json!(check));
    }
    op
}

/// A module's own route: its documentation as the module wrote it, with the permission and the errors added.
fn route_item(module: &str, route: &crate::module::Route, answer: Option<Value>) -> Value {
    let mut op = match &route.doc {
        Some(Value::Object(o)) => o.clone(),
        _ => Map::new(),
    };
    op.entry("operationId")
        .or_insert_with(|| json!(format!("{} {}", route.http_method, route.path)));
    op.entry("summary")
        .or_insert_with(|| json!(format!("{} {}", route.http_method, route.path)));
    op.insert("x-module".into(), json!(module));
    if let Some(p) = route.permission {
        op.insert("x-permission".into(), json!(p.name()));
    }
    let responses = op
        .entry("responses")
        .or_insert_with(|| json!({ "200": { "description": "Done." } }));
    if let (Some(schema), Value::Object(r)) = (answer, &mut *responses) {
        r.insert(
            "200".into(),
            json!({ "description": "The answer.", "content": { "application/json": { "schema": schema } } }),
        );
    }
    if let Value::Object(r) = responses {
        for (status, _, _) in ERROR_STATUSES {
            r.entry(*status)
                .or_insert_with(|| json!({ "$ref": format!("#/components/responses/E{status}") }));
        }
    }
    json!({ route.http_method.to_ascii_lowercase(): Value::Object(op) })
}

fn api_error_schema() -> Value {
    let codes: Vec<&str> = ApiCode::ALL.iter().map(|c| c.as_str()).collect();
    json!({
        "type": "object",
        "description": "Every error the API answers, its own and the HTTP layer's.",
        "properties": {
            "code": {
                "type": "string",
                "enum": codes,
                "description": "Stable; a client branches on it.",
            },
            "message": {
                "type": "string",
                "description": "What went wrong and what to do next, for a person.",
            },
        },
        "required": ["code", "message"],
        "additionalProperties": false,
    })
}

fn error_response(description: &str, codes: &[ApiCode]) -> Value {
    let codes: Vec<&str> = codes.iter().map(|c| c.as_str()).collect();
    json!({
        "description": format!("{description} Code: {}.", codes.join(" or ")),
        "content": {
            "application/json": {
                "schema": { "$ref": "#/components/schemas/ApiError" },
                "example": { "code": codes[0], "message": "…" },
            },
        },
    })
}

fn kernel_paths() -> Vec<(&'static str, Value)> {
    vec![
        (
            "/healthz",
            json!({ "get": {
                "operationId": "healthz",
                "summary": "Liveness",
                "description": "200 `ok` while the process serves HTTP. It checks nothing else (not the database): \
                    a failing /healthz means restart the process; use /readyz to decide whether to send it traffic.",
                "security": [],
                "responses": {
                    "200": { "description": "The process serves.", "content": { "text/plain": { "schema": { "type": "string", "const": "ok" } } } },
                },
            }}),
        ),
        (
            "/readyz",
            json!({ "get": {
                "operationId": "readyz",
                "summary": "Readiness",
                "description": "200 `{\"ready\": true}` when this process can answer API calls: its modules started \
                    and its database answers a query within 2 s (checked on every request). 503 with \
                    `{code: UNAVAILABLE, message}` naming the cause otherwise: take the process out of the load \
                    balancer, do not restart it.",
                "security": [],
                "responses": {
                    "200": {
                        "description": "Ready.",
                        "content": { "application/json": { "schema": {
                            "type": "object",
                            "properties": { "ready": { "type": "boolean", "const": true } },
                            "required": ["ready"],
                        } } },
                    },
                    "503": { "$ref": "#/components/responses/E503" },
                },
            }}),
        ),
        (
            OPENAPI_PATH,
            json!({ "get": {
                "operationId": "openapi",
                "summary": "This document",
                "description": "The OpenAPI 3.1 document of this control plane (its modules and plugins); no key \
                    needed.",
                "security": [],
                "responses": {
                    "200": { "description": "The document.", "content": { "application/json": { "schema": { "type": "object" } } } },
                },
            }}),
        ),
    ]
}

// === the Markdown reference ===

/// The document as a Markdown reference (docs/api-reference.md): one section per group, each method with its
/// permission, scope, request and answer fields; then the other paths and the error codes.
pub fn markdown(doc: &Value) -> String {
    let mut out = String::new();
    out.push_str(
        "# API reference\n\n<!-- Generated from docs/openapi.json by control/server/tests/openapi.rs; do not edit. \
         Rewrite with BC_UPDATE_GOLDEN=1. -->\n\n",
    );
    if let Some(d) = doc["info"]["description"].as_str() {
        out.push_str(d);
        out.push_str("\n\n");
    }
    let empty = Map::new();
    let paths = doc["paths"].as_object().unwrap_or(&empty);
    let schemas = doc["components"]["schemas"].as_object().unwrap_or(&empty);
    let mut group = String::new();
    let mut others = Vec::new();
    for (path, item) in paths {
        let Some(method) = path.strip_prefix("/api/compute/") else {
            others.push((path, item));
            continue;
        };
        let op = &item["post"];
        let g = op["tags"][0].as_str().unwrap_or_default();
        if g != group {
            group = g.to_string();
            out.push_str(&format!("## {group}\n\n"));
        }
        out.push_str(&format!("### `{}`\n\n", method.replace('/', ".")));
        out.push_str(&format!(
            "`POST {path}` (module `{}`). ",
            op["x-module"].as_str().unwrap_or("")
        ));
        out.push_str(op["description"].as_str().unwrap_or_default());
        out.push_str("\n\n");
        let request = &op["requestBody"]["content"]["application/json"]["schema"];
        let response = &op["responses"]["200"]["content"]["application/json"]["schema"];
        out.push_str(&fields("Request", request, schemas));
        out.push_str(&fields("Answer", response, schemas));
    }
    out.push_str("## Types\n\nThe schemas the methods refer to (`components/schemas`).\n\n");
    for (name, schema) in schemas {
        out.push_str(&format!("### {name}\n\n"));
        if let Some(d) = schema["description"].as_str() {
            out.push_str(&one_line(d));
            out.push_str("\n\n");
        }
        if schema["properties"].is_object() {
            out.push_str(&fields("Fields", schema, schemas));
        } else if let Some(variants) = schema["oneOf"].as_array().or(schema["anyOf"].as_array()) {
            out.push_str("One of:\n\n");
            for v in variants {
                let fields: Vec<String> = v["properties"]
                    .as_object()
                    .map(|p| {
                        p.iter()
                            .map(|(k, s)| format!("`{k}`: {}", type_of(s)))
                            .collect()
                    })
                    .unwrap_or_else(|| vec![type_of(v)]);
                out.push_str(&format!("- {}\n", fields.join(", ")));
            }
            out.push('\n');
        } else {
            out.push_str(&format!("{}\n\n", type_of(schema)));
        }
    }
    out.push_str("## Other paths\n\n| path | method | what |\n|---|---|---|\n");
    for (path, item) in others {
        for (verb, op) in item.as_object().unwrap_or(&empty) {
            let what = op["description"]
                .as_str()
                .or(op["summary"].as_str())
                .unwrap_or_default();
            out.push_str(&format!(
                "| `{path}` | {} | {} |\n",
                verb.to_ascii_uppercase(),
                one_line(what)
            ));
        }
    }
    out.push_str("\n## Errors\n\nEvery error is `{\"code\": …, \"message\": …}`.\n\n| status | meaning |\n|---|---|\n");
    for (status, r) in doc["components"]["responses"].as_object().unwrap_or(&empty) {
        out.push_str(&format!(
            "| {} | {} |\n",
            status.trim_start_matches('E'),
            one_line(r["description"].as_str().unwrap_or_default())
        ));
    }
    out
}

fn one_line(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// A table of the schema's properties (following one `$ref`), or its type name.
fn fields(title: &str, schema: &Value, schemas: &Map<String, Value>) -> String {
    let (name, resolved) = resolve(schema, schemas);
    let props = resolved["properties"].as_object();
    let Some(props) = props.filter(|p| !p.is_empty()) else {
        return format!("{title}: `{}` (no fields).\n\n", name.unwrap_or("{}"));
    };
    let required: Vec<&str> = resolved["required"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let named = name.map_or_else(|| ":".to_string(), |n| format!(": `{n}`"));
    let mut out = format!("{title}{named}\n\n| field | type | |\n|---|---|---|\n");
    for (field, s) in props {
        out.push_str(&format!(
            "| `{field}` | {} | {}{} |\n",
            type_of(s),
            if required.contains(&field.as_str()) {
                "required. "
            } else {
                ""
            },
            one_line(s["description"].as_str().unwrap_or_default())
        ));
    }
    out.push('\n');
    out
}

fn resolve<'a>(schema: &'a Value, schemas: &'a Map<String, Value>) -> (Option<&'a str>, &'a Value) {
    match schema["$ref"].as_str().and_then(|r| r.rsplit('/').next()) {
        Some(name) => (Some(name), schemas.get(name).unwrap_or(&Value::Null)),
        None => (None, schema),
    }
}

/// A short type: `string`, `integer (unix-epoch-ms)`, `[Node]`, `NodeState`, `string or null`.
fn type_of(s: &Value) -> String {
    if let Some(r) = s["$ref"].as_str() {
        return format!("`{}`", r.rsplit('/').next().unwrap_or(r));
    }
    if let Some(c) = s.get("const") {
        return format!("`{c}`");
    }
    if let Some(any) = s["anyOf"].as_array().or(s["oneOf"].as_array()) {
        return any.iter().map(type_of).collect::<Vec<_>>().join(" or ");
    }
    let base = match &s["type"] {
        Value::String(t) if t == "array" => format!("[{}]", type_of(&s["items"])),
        Value::String(t) => t.clone(),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" or "),
        _ if s.get("enum").is_some() => "enum".into(),
        _ => "any".into(),
    };
    let base = match s["format"].as_str() {
        Some(f) => format!("{base} ({f})"),
        None => base,
    };
    match s["enum"].as_array() {
        Some(e) if e.len() <= 12 => format!(
            "{base}: {}",
            e.iter()
                .map(|v| format!("`{}`", v.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => base,
    }
}
