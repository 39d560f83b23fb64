//! EC2's Query API, sans I/O: the form bodies of the five actions the provider workflow calls
//! (`DescribeInstances`, `RunInstances`, `StartInstances`, `StopInstances`, `TerminateInstances`, plus
//! `RebootInstances`) and the decoder of their XML answers ([`decode`]). The decoder reads only what the workflow
//! needs — each instance's id, state and tags, or the error's code and message — and rejects anything else it
//! cannot read with an error naming the element; it never panics on input (fuzz target `ec2_response`).

use serde::{Deserialize, Serialize};

/// The API version every request names (the one EC2's Query API has answered to since 2016).
pub const API_VERSION: &str = "2016-11-15";
/// The tag that marks an instance as this control plane's: its value is the instance id. The workflow finds an
/// instance it may have launched by this tag before it launches one (moto, unlike EC2, ignores client tokens).
pub const TAG: &str = "bc-instance-id";
/// The largest answer the decoder reads (a describe of one instance is a few KiB).
pub const MAX_ANSWER: usize = 1024 * 1024;

/// The state of an EC2 instance (`instanceState/name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ec2State {
    Pending,
    Running,
    ShuttingDown,
    Terminated,
    Stopping,
    Stopped,
}

impl Ec2State {
    pub const ALL: [Ec2State; 6] = [
        Ec2State::Pending,
        Ec2State::Running,
        Ec2State::ShuttingDown,
        Ec2State::Terminated,
        Ec2State::Stopping,
        Ec2State::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Ec2State::Pending => "pending",
            Ec2State::Running => "running",
            Ec2State::ShuttingDown => "shutting-down",
            Ec2State::Terminated => "terminated",
            Ec2State::Stopping => "stopping",
            Ec2State::Stopped => "stopped",
        }
    }

    pub fn parse(s: &str) -> Option<Ec2State> {
        Ec2State::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl std::fmt::Display for Ec2State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One instance as an answer lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ec2Instance {
    pub instance_id: String,
    pub state: Ec2State,
    /// The value of its [`TAG`] tag, when it has one.
    pub bc_instance_id: Option<String>,
}

/// What an answer said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ec2Answer {
    /// `DescribeInstancesResponse` or `RunInstancesResponse`: the instances it lists.
    Instances(Vec<Ec2Instance>),
    /// `StartInstancesResponse`, `StopInstancesResponse`, `TerminateInstancesResponse`: each instance's current
    /// state (`currentState`).
    StateChanges(Vec<(String, Ec2State)>),
    /// `RebootInstancesResponse`: `return` true.
    Accepted,
    /// An error document (`Response/Errors/Error`): the first error's code and message.
    Error { code: String, message: String },
}

/// Why an answer could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("the answer is {0} bytes, more than {MAX_ANSWER}")]
    TooLarge(usize),
    #[error("the answer is not XML: {0}")]
    Xml(String),
    #[error("unexpected answer document <{0}>")]
    Document(String),
    #[error("{0}: missing")]
    Missing(&'static str),
    #[error("instance {id:?}: unknown state {state:?}")]
    State { id: String, state: String },
}

/// The form body of an action: `Action`, `Version` and the parameters in order (the caller URL-encodes them).
pub type Form = Vec<(String, String)>;

fn form(action: &str) -> Form {
    vec![
        ("Action".into(), action.into()),
        ("Version".into(), API_VERSION.into()),
    ]
}

/// `DescribeInstances` of the instance tagged [`TAG`] = `instance` (every state, terminated ones included).
pub fn describe_by_tag(instance: &str) -> Form {
    let mut f = form("DescribeInstances");
    f.push(("Filter.1.Name".into(), format!("tag:{TAG}")));
    f.push(("Filter.1.Value.1".into(), instance.into()));
    f
}

/// `DescribeInstances` of one provider instance id.
pub fn describe_by_id(provider_id: &str) -> Form {
    let mut f = form("DescribeInstances");
    f.push(("InstanceId.1".into(), provider_id.into()));
    f
}

/// What `RunInstances` launches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch<'a> {
    /// This control plane's instance id: tagged as [`TAG`] and the source of the client token.
    pub instance: &'a str,
    pub image_id: &'a str,
    pub instance_type: &'a str,
    /// Base64 of the user data, when there is any.
    pub user_data_b64: Option<&'a str>,
}

/// The client token of instance `instance`: the same for every launch of it, so EC2 itself answers a repeated
/// launch with the first one's instance (at most 64 ASCII characters).
pub fn client_token(instance: &str) -> String {
    let mut t = format!("bc-{instance}");
    let mut end = t.len().min(64);
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    t.truncate(end);
    t
}

/// `RunInstances` of exactly one instance, tagged and with its client token.
pub fn run_instances(l: &Launch<'_>) -> Form {
    let mut f = form("RunInstances");
    for (k, v) in [
        ("ImageId", l.image_id.to_string()),
        ("InstanceType", l.instance_type.to_string()),
        ("MinCount", "1".into()),
        ("MaxCount", "1".into()),
        ("ClientToken", client_token(l.instance)),
        ("TagSpecification.1.ResourceType", "instance".into()),
        ("TagSpecification.1.Tag.1.Key", TAG.into()),
        ("TagSpecification.1.Tag.1.Value", l.instance.into()),
    ] {
        f.push((k.into(), v));
    }
    if let Some(u) = l.user_data_b64 {
        f.push(("UserData".into(), u.into()));
    }
    f
}

/// `StartInstances`, `StopInstances`, `TerminateInstances` or `RebootInstances` of one instance.
pub fn change_state(action: StateAction, provider_id: &str) -> Form {
    let mut f = form(action.as_str());
    f.push(("InstanceId.1".into(), provider_id.into()));
    f
}

/// The actions that change one instance's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateAction {
    Start,
    Stop,
    Terminate,
    Reboot,
}

impl StateAction {
    pub fn as_str(self) -> &'static str {
        match self {
            StateAction::Start => "StartInstances",
            StateAction::Stop => "StopInstances",
            StateAction::Terminate => "TerminateInstances",
            StateAction::Reboot => "RebootInstances",
        }
    }
}

// === decode ===

fn child<'a, 'i>(n: roxmltree::Node<'a, 'i>, name: &str) -> Option<roxmltree::Node<'a, 'i>> {
    n.children()
        .find(|c| c.is_element() && c.tag_name().name() == name)
}

fn items<'a, 'i>(n: roxmltree::Node<'a, 'i>) -> impl Iterator<Item = roxmltree::Node<'a, 'i>> {
    n.children()
        .filter(|c| c.is_element() && c.tag_name().name() == "item")
}

fn text(n: roxmltree::Node<'_, '_>, name: &'static str) -> Result<String, DecodeError> {
    child(n, name)
        .and_then(|c| c.text())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .ok_or(DecodeError::Missing(name))
}

fn state(
    id: &str,
    n: roxmltree::Node<'_, '_>,
    name: &'static str,
) -> Result<Ec2State, DecodeError> {
    let s = child(n, name).ok_or(DecodeError::Missing(name))?;
    let v = text(s, "name")?;
    Ec2State::parse(&v).ok_or_else(|| DecodeError::State {
        id: id.to_owned(),
        state: v,
    })
}

fn instance(n: roxmltree::Node<'_, '_>) -> Result<Ec2Instance, DecodeError> {
    let instance_id = text(n, "instanceId")?;
    let state = state(&instance_id, n, "instanceState")?;
    let bc_instance_id = child(n, "tagSet").and_then(|tags| {
        items(tags).find_map(|t| {
            (text(t, "key").ok().as_deref() == Some(TAG)).then(|| text(t, "value").ok())?
        })
    });
    Ok(Ec2Instance {
        instance_id,
        state,
        bc_instance_id,
    })
}

fn instances_set(n: roxmltree::Node<'_, '_>) -> Result<Vec<Ec2Instance>, DecodeError> {
    match child(n, "instancesSet") {
        Some(set) => items(set).map(instance).collect(),
        None => Ok(Vec::new()),
    }
}

/// Decodes an answer of EC2's Query API (any of the actions above, or an error document).
pub fn decode(body: &str) -> Result<Ec2Answer, DecodeError> {
    if body.len() > MAX_ANSWER {
        return Err(DecodeError::TooLarge(body.len()));
    }
    let doc = roxmltree::Document::parse(body).map_err(|e| DecodeError::Xml(e.to_string()))?;
    let root = doc.root_element();
    match root.tag_name().name() {
        "Response" | "ErrorResponse" => {
            let errors = child(root, "Errors").ok_or(DecodeError::Missing("Errors"))?;
            let error = child(errors, "Error").ok_or(DecodeError::Missing("Error"))?;
            Ok(Ec2Answer::Error {
                code: text(error, "Code")?,
                message: text(error, "Message").unwrap_or_default(),
            })
        }
        "DescribeInstancesResponse" => {
            let mut out = Vec::new();
            if let Some(set) = child(root, "reservationSet") {
                for r in items(set) {
                    out.extend(instances_set(r)?);
                }
            }
            Ok(Ec2Answer::Instances(out))
        }
        "RunInstancesResponse" => Ok(Ec2Answer::Instances(instances_set(root)?)),
        "StartInstancesResponse" | "StopInstancesResponse" | "TerminateInstancesResponse" => {
            let set = child(root, "instancesSet").ok_or(DecodeError::Missing("instancesSet"))?;
            items(set)
                .map(|i| {
                    let id = text(i, "instanceId")?;
                    let s = state(&id, i, "currentState")?;
                    Ok((id, s))
                })
                .collect::<Result<_, _>>()
                .map(Ec2Answer::StateChanges)
        }
        "RebootInstancesResponse" => match text(root, "return")?.as_str() {
            "true" => Ok(Ec2Answer::Accepted),
            other => Err(DecodeError::Xml(format!("return is {other:?}"))),
        },
        other => Err(DecodeError::Document(other.chars().take(64).collect())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DESCRIBE: &str = r#"<?xml version="1.0" encoding="utf-8"?>
<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15"><reservationSet><item>
<reservationId>r-9ef4</reservationId><instancesSet><item><groupSet/><stateReason><code/><message/></stateReason>
<tagSet><item><key>other</key><value>x</value></item><item><key>bc-instance-id</key><value>inst-1</value></item></tagSet>
<instanceId>i-1a2b</instanceId><imageId>ami-1</imageId><instanceState><code>16</code><name>running</name></instanceState>
</item></instancesSet></item></reservationSet><requestId>request-id</requestId></DescribeInstancesResponse>"#;

    #[test]
    fn reads_what_moto_and_ec2_answer() {
        assert_eq!(
            decode(DESCRIBE),
            Ok(Ec2Answer::Instances(vec![Ec2Instance {
                instance_id: "i-1a2b".into(),
                state: Ec2State::Running,
                bc_instance_id: Some("inst-1".into()),
            }]))
        );
        let empty =
            r#"<DescribeInstancesResponse xmlns="x"><reservationSet/></DescribeInstancesResponse>"#;
        assert_eq!(decode(empty), Ok(Ec2Answer::Instances(vec![])));
        let stop = r#"<StopInstancesResponse><instancesSet><item><instanceId>i-1</instanceId><currentState>
            <code>64</code><name>stopping</name></currentState><previousState><code>16</code><name>running</name>
            </previousState></item></instancesSet></StopInstancesResponse>"#;
        assert_eq!(
            decode(stop),
            Ok(Ec2Answer::StateChanges(vec![(
                "i-1".into(),
                Ec2State::Stopping
            )]))
        );
        let err = r#"<Response><Errors><Error><Code>InvalidInstanceID.NotFound</Code><Message>The instance ID
            'i-nope' does not exist</Message></Error></Errors><RequestID>x</RequestID></Response>"#;
        assert!(
            matches!(decode(err), Ok(Ec2Answer::Error { code, .. }) if code == "InvalidInstanceID.NotFound")
        );
        let reboot = "<RebootInstancesResponse><return>true</return></RebootInstancesResponse>";
        assert_eq!(decode(reboot), Ok(Ec2Answer::Accepted));
    }

    #[test]
    fn bad_answers_are_errors_naming_what_is_wrong() {
        assert!(matches!(decode("not xml"), Err(DecodeError::Xml(_))));
        assert!(matches!(decode("<Other/>"), Err(DecodeError::Document(d)) if d == "Other"));
        let bad_state = DESCRIBE.replace("<name>running</name>", "<name>melting</name>");
        assert!(
            matches!(decode(&bad_state), Err(DecodeError::State { state, .. }) if state == "melting")
        );
        let no_id = DESCRIBE.replace("<instanceId>i-1a2b</instanceId>", "");
        assert_eq!(decode(&no_id), Err(DecodeError::Missing("instanceId")));
        let big = "x".repeat(MAX_ANSWER + 1);
        assert_eq!(decode(&big), Err(DecodeError::TooLarge(MAX_ANSWER + 1)));
        // An entity bomb is refused by the parser (roxmltree limits entity expansion).
        let bomb = r#"<!DOCTYPE d [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">
            <!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>
            <Response><Errors><Error><Code>&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;</Code></Error></Errors></Response>"#;
        assert!(decode(bomb).is_ok() || matches!(decode(bomb), Err(DecodeError::Xml(_))));
    }

    #[test]
    fn forms_name_the_action_token_and_tag() {
        let f = run_instances(&Launch {
            instance: "inst-0190",
            image_id: "ami-1",
            instance_type: "t3.micro",
            user_data_b64: Some("I2Nsb3Vk"),
        });
        let get = |k: &str| f.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("Action"), Some("RunInstances"));
        assert_eq!(get("ClientToken"), Some("bc-inst-0190"));
        assert_eq!(get("TagSpecification.1.Tag.1.Value"), Some("inst-0190"));
        assert_eq!(get("UserData"), Some("I2Nsb3Vk"));
        assert_eq!(client_token(&"x".repeat(100)).len(), 64);
        // Cut on a character boundary (a byte cut inside `é` would panic).
        assert_eq!(client_token(&format!("{}é", "x".repeat(60))).len(), 63);
        let d = describe_by_tag("inst-1");
        assert!(d.contains(&("Filter.1.Name".into(), "tag:bc-instance-id".into())));
    }
}
