// Package dynsec keeps Mosquitto's accounts and ACLs in step with the
// store, by driving Mosquitto 2's dynamic-security plugin over its control
// topic ($CONTROL/dynamic-security/v1) on the server's own MQTT connection.
//
// Each bridge gets a client (username = bridge id, password = its secret,
// client id companion-bridge-ID and no other) with the role bridge-ID; each
// user a client (username = user id, password = API token, client id
// companion-user-ID) with the role user-ID, whose ACLs grant reading the
// topics of the user's devices and nothing else. Tying each account to its
// client id keeps it from taking the server's session, or a bridge's
// (BridgeClientID). Passwords are known only when the
// account is created, so a creation that fails is retried only while the
// process runs; bindings are re-read from the store and reconciled on every
// connect. The roles named bridge-* and user-* belong to the server.
//
// It is not used with the embedded broker, which asks the store directly
// (broker.Accounts).
package dynsec

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// The plugin's control API (Mosquitto 2.0).
const (
	ControlTopic  = "$CONTROL/dynamic-security/v1"
	ResponseTopic = ControlTopic + "/response"
)

// ACL types of the plugin.
const (
	SubscribePattern     = "subscribePattern"
	PublishClientSend    = "publishClientSend"
	PublishClientReceive = "publishClientReceive"
)

// Command is one command of the control API, such as
// {"command": "createClient", "username": "…", "password": "…"}.
type Command map[string]any

// Response is the plugin's answer to one command.
type Response struct {
	Command         string          `json:"command"`
	Error           string          `json:"error,omitempty"`
	Data            json.RawMessage `json:"data,omitempty"`
	CorrelationData string          `json:"correlationData,omitempty"`
}

// Err is the response's error, or nil when the command succeeded.
func (r Response) Err() error {
	if r.Error == "" {
		return nil
	}
	return &CommandError{Command: r.Command, Message: r.Error}
}

// CommandError is a command the plugin refused, with its reason
// ("Client already exists", "ACL not found", …).
type CommandError struct {
	Command, Message string
}

func (e *CommandError) Error() string {
	return fmt.Sprintf("dynsec: %s: %s", e.Command, e.Message)
}

// alreadyExists reports a refusal because the object is already there,
// which for an idempotent change means it is done.
func alreadyExists(err error) bool {
	var ce *CommandError
	return errors.As(err, &ce) && strings.Contains(ce.Message, "already exists")
}

// notFound reports a refusal because the object is not there.
func notFound(err error) bool {
	var ce *CommandError
	return errors.As(err, &ce) && strings.Contains(ce.Message, "not found")
}

// ACL is one access rule of a role.
type ACL struct {
	Type  string `json:"acltype"`
	Topic string `json:"topic"`
	Allow bool   `json:"allow"`
}

// role is a role as listRoles reports it.
type role struct {
	Name string `json:"rolename"`
	ACLs []ACL  `json:"acls"`
}

func addACL(roleName string, a ACL) Command {
	return Command{"command": "addRoleACL", "rolename": roleName, "acltype": a.Type, "topic": a.Topic, "allow": true, "priority": 0}
}

func removeACL(roleName string, a ACL) Command {
	return Command{"command": "removeRoleACL", "rolename": roleName, "acltype": a.Type, "topic": a.Topic}
}

// DenyByDefault is the setDefaultACLAccess command the server sends on every
// connect: whatever a role does not grant is refused, including the
// delivery of messages (publishClientReceive), which the plugin allows by
// default. Unsubscribing stays allowed.
func DenyByDefault() Command {
	return Command{"command": "setDefaultACLAccess", "acls": []map[string]any{
		{"acltype": PublishClientSend, "allow": false},
		{"acltype": PublishClientReceive, "allow": false},
		{"acltype": "subscribe", "allow": false},
		{"acltype": "unsubscribe", "allow": true},
	}}
}
