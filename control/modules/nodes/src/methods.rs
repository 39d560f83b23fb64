//! The nodes module's API methods, declared once for its handlers and for clients (the operator CLI), and their
//! registration with permission and scope: the kernel checks a scope taken from the request before the handler
//! runs; a node's or token's pool is known once the handler read it (`Cx::authorize`); lists show what the
//! caller may see (`Cx::allows`).

use crate::{api, commands};
use bc_core::api::nodes::*;
use bc_kernel::{Method, Module, Scope};

bc_kernel::api_method!(
    /// `join-tokens.create`.
    pub CreateJoinTokenMethod = "join-tokens" / "create": CreateJoinToken => CreatedJoinToken
);
bc_kernel::api_method!(
    /// `join-tokens.list`.
    pub ListJoinTokensMethod = "join-tokens" / "list": ListJoinTokens => JoinTokens
);
bc_kernel::api_method!(
    /// `join-tokens.revoke`.
    pub RevokeJoinTokenMethod = "join-tokens" / "revoke": JoinTokenRef => RevokedJoinToken
);
bc_kernel::api_method!(
    /// `nodes.list`.
    pub ListNodesMethod = "nodes" / "list": ListNodes => Nodes
);
bc_kernel::api_method!(
    /// `nodes.get`.
    pub GetNodeMethod = "nodes" / "get": NodeRef => NodeDetail
);
bc_kernel::api_method!(
    /// `nodes.drain`.
    pub DrainNodeMethod = "nodes" / "drain": NodeRef => NodeStateChanged
);
bc_kernel::api_method!(
    /// `nodes.undrain`.
    pub UndrainNodeMethod = "nodes" / "undrain": NodeRef => NodeStateChanged
);
bc_kernel::api_method!(
    /// `nodes.revoke`.
    pub RevokeNodeMethod = "nodes" / "revoke": NodeRef => NodeStateChanged
);
bc_kernel::api_method!(
    /// `nodes.command`.
    pub QueueCommandMethod = "nodes" / "command": QueueCommand => QueuedCommand
);
bc_kernel::api_method!(
    /// `nodes.delete`.
    pub DeleteNodeMethod = "nodes" / "delete": NodeRef => DeletedNode
);
bc_kernel::api_method!(
    /// `commands.list`.
    pub ListCommandsMethod = "commands" / "list": ListCommands => Commands
);
bc_kernel::api_method!(
    /// `commands.get`.
    pub GetCommandMethod = "commands" / "get": CommandRef => CommandDetail
);

const POOL: &str = "pool/<pool>";

pub(crate) fn register(module: Module) -> Module {
    use bc_core::node::NodeVerb;
    module
        .method(
            Method::<CreateJoinTokenMethod>::new()
                .permission("compute:join-tokens:create")
                .scope_from_request(POOL, |r| format!("pool/{}", r.pool))
                .handler(api::create_join_token),
        )
        .method(
            Method::<ListJoinTokensMethod>::new()
                .permission("compute:join-tokens:list")
                .scope(Scope::filtered(POOL))
                .handler(api::list_join_tokens),
        )
        .method(
            Method::<RevokeJoinTokenMethod>::new()
                .permission("compute:join-tokens:revoke")
                .scope(Scope::resource(POOL))
                .handler(api::revoke_join_token),
        )
        .method(
            Method::<ListNodesMethod>::new()
                .permission("compute:nodes:list")
                .scope(Scope::filtered(POOL))
                .handler(api::list_nodes),
        )
        .method(
            Method::<GetNodeMethod>::new()
                .permission("compute:nodes:get")
                .scope(Scope::resource(POOL))
                .handler(api::get_node),
        )
        .method(
            Method::<DrainNodeMethod>::new()
                .permission("compute:nodes:drain")
                .scope(Scope::resource(POOL))
                .handler(|cx, r| api::set_node_state(cx, r, NodeVerb::Drain)),
        )
        .method(
            Method::<UndrainNodeMethod>::new()
                .permission("compute:nodes:undrain")
                .scope(Scope::resource(POOL))
                .handler(|cx, r| api::set_node_state(cx, r, NodeVerb::Undrain)),
        )
        .method(
            Method::<RevokeNodeMethod>::new()
                .permission("compute:nodes:revoke")
                .scope(Scope::resource(POOL))
                .handler(|cx, r| api::set_node_state(cx, r, NodeVerb::Revoke)),
        )
        .method(
            Method::<QueueCommandMethod>::new()
                .permission("compute:nodes:command")
                .scope(Scope::resource(POOL))
                .handler(commands::queue),
        )
        .method(
            Method::<DeleteNodeMethod>::new()
                .permission("compute:nodes:delete")
                .scope(Scope::resource(POOL))
                .handler(api::delete_node),
        )
        .method(
            Method::<ListCommandsMethod>::new()
                .permission("compute:nodes:get")
                .scope(Scope::resource(POOL))
                .handler(commands::list),
        )
        .method(
            Method::<GetCommandMethod>::new()
                .permission("compute:nodes:get")
                .scope(Scope::resource(POOL))
                .handler(commands::get),
        )
}
